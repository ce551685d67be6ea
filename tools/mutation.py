"""Mutation check: break the code on purpose, one small change at a time, and see whether the tests notice.

Run it on demand (``make mutation``; not part of ``make test``: it is slow)::

    python tools/mutation.py                 # the curated catalogue (tools/mutants.py), ~70 mutants
    python tools/mutation.py --only break-3  # one mutant (ids as in the catalogue; repeatable)
    python tools/mutation.py --all           # the catalogue + every operator/constant mutant of the core modules
    python tools/mutation.py --all --skip-catalogue --sample 20   # 20 operator mutants drawn at random
    python tools/mutation.py --list          # print the mutants, run nothing
    python tools/mutation.py --check         # check that every catalogue entry still applies, run nothing

Each mutant is applied to a scratch copy of the repository (``src/``, ``tests/``, ``recipes/``; the real tree is
never touched), and the tests mapped to the mutated module (:data:`TESTS`) run against it with ``PYTHONPATH``
pointing at the scratch ``src`` (``-x``: the first failure kills the mutant), under a timeout (a hang counts as
killed). The unmutated code must pass the same tests first (once per test set), or the run stops.

A mutant that survives is either killed by a new test, or marked ``harmless`` in the catalogue with the reason
(docs/design/testing.md lists them). Results go to ``runs/mutation-results.md`` (``--out``); the exit status is 1 when a
mutant not marked harmless survives. ``--tests-dir DIR`` runs the mutants against another copy of the tests (e.g.
an older revision's, to compare survivor rates).
"""

from __future__ import annotations

import argparse
import io
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tokenize
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

from mutants import CATALOGUE, Mutant  # noqa: E402

#: The tests of a calibration run, layer step and whole-model loop alike (calib/runner.py, calib/layer_calibration.py).
_CALIBRATION_RUN_TESTS = [
    "tests/calib/test_runner_options.py",
    "tests/layerwise/test_qdq_reference.py",
    "tests/calib/test_fingerprint_options.py",
    "tests/contracts/test_padding_reference.py",
    "tests/layerwise/test_moe_reference.py",
    "tests/calib/test_calibrate.py",
]

#: Module (path under src/shardcal) -> the tests that guard it, fastest and most telling first.
TESTS: dict[str, list[str]] = {
    "calib/passes.py": ["tests/calib/test_passes.py", "tests/algorithms/test_algorithms.py"],
    "models/checkpoint.py": [
        "tests/loading/test_reads_own_rows.py",
        "tests/loading/test_loading_errors.py",
        "tests/sharding/test_fsdp2.py",
    ],
    "loading/sharded.py": ["tests/loading/test_reads_own_rows.py", "tests/sharding/test_fsdp2.py"],
    "loading/sources.py": [
        "tests/loading/test_reads_own_rows.py",
        "tests/loading/test_foreign_models.py::test_load_pretrained_shards_any_module_each_rank_reading_its_rows",
    ],
    "layerwise/batches.py": [
        "tests/calib/test_runner_options.py",
        "tests/contracts/test_padding_reference.py",
        "tests/calib/test_fingerprint_options.py",
        "tests/calib/test_calibrate.py",
        "tests/contracts/test_bad_inputs.py",
    ],
    "quant/tokens.py": [
        "tests/contracts/test_padding_reference.py",
        "tests/layerwise/test_moe_reference.py",
        "tests/calib/test_calibrate.py::test_padding_never_counts",
        "tests/loading/test_foreign_models.py::test_padded_batches_use_the_models_own_masks",
    ],
    "quant/formats.py": [
        "tests/quant/test_quant_formats.py",
        "tests/quant/test_quant_observers.py",
        "tests/quant/test_quant_linear.py",
    ],
    "quant/granularity.py": [
        "tests/quant/test_quant_formats.py",
        "tests/quant/test_quant_observers.py",
        "tests/quant/test_quant_linear.py",
    ],
    "quant/observers.py": [
        "tests/quant/test_quant_observers.py",
        "tests/quant/test_quant_references.py",
        "tests/quant/test_quant_linear.py",
    ],
    "quant/quantizer.py": [
        "tests/quant/test_quant_references.py",
        "tests/quant/test_quant_linear.py",
        "tests/quant/test_quant_observers.py",
        "tests/contracts/test_padding_reference.py",
        "tests/calib/test_calibrate.py",
    ],
    "quant/merge.py": ["tests/quant/test_quant_observers.py", "tests/calib/test_calibrate.py"],
    "quant/reuse.py": ["tests/quant/test_quant_observers.py", "tests/quant/test_quant_linear.py"],
    "quant/session.py": [
        "tests/quant/test_quant_references.py",
        "tests/quant/test_quant_observers.py",
        "tests/calib/test_calibrate.py",
    ],
    "quant/experts.py": ["tests/layerwise/test_moe_reference.py", "tests/loading/test_foreign_models.py"],
    "quant/expert_layout.py": [
        "tests/quant/test_fused_experts_layouts.py",
        "tests/layerwise/test_moe_reference.py",
        "tests/loading/test_foreign_models.py",
    ],
    "layerwise/moe.py": ["tests/layerwise/test_moe_reference.py", "tests/calib/test_calibrate.py"],
    "sharding/fsdp2.py": [
        "tests/sharding/test_fsdp2.py",
        "tests/sharding/test_sharded_edits.py",
        "tests/calib/test_calibrate.py",
        "tests/algorithms/test_algorithms.py",
    ],
    "layerwise/steps.py": [
        "tests/layerwise/test_layer_steps.py",
        "tests/calib/test_runner_options.py",
        "tests/quant/test_kv_cache.py",
        "tests/layerwise/test_qdq_reference.py",
        "tests/contracts/test_padding_reference.py",
        "tests/calib/test_calibrate.py",
    ],
    "calib/runner.py": _CALIBRATION_RUN_TESTS,
    "calib/layer_calibration.py": _CALIBRATION_RUN_TESTS,
    "calib/report.py": ["tests/calib/test_calibrate.py", "tests/cli/test_cli.py"],
    "calib/calibration_checkpoint.py": ["tests/calib/test_fingerprint_options.py", "tests/calib/test_calibrate.py"],
    "layerwise/layer_checkpoint.py": [
        "tests/calib/test_fingerprint_options.py",
        "tests/calib/test_calibrate.py",
        "tests/layerwise/test_checkpoint_kinds.py",
    ],
    "algorithms/smoothquant.py": ["tests/algorithms/test_algorithms.py"],
    "export/layout.py": [
        "tests/export/test_export_claims.py",
        "tests/export/test_export.py",
        "tests/export/test_export_families.py",
    ],
    "export/quant_modules.py": [
        "tests/export/test_export_claims.py",
        "tests/export/test_export.py",
        "tests/export/test_export_families.py",
    ],
    "export/compressed_tensors/tensors.py": ["tests/export/test_export.py"],
    "export/compressed_tensors/config.py": ["tests/export/test_export.py", "tests/calib/test_rotation.py"],
    "export/shards.py": ["tests/export/test_export_claims.py", "tests/export/test_export.py"],
    "export/export.py": ["tests/export/test_export.py"],
    "export/destination.py": ["tests/export/test_export.py"],
    "export/metadata.py": [
        "tests/export/test_export.py",
        "tests/cli/test_cli.py::test_eval_of_an_export_also_gives_its_source_models_perplexity",
    ],
    "data/perplexity.py": ["tests/cli/test_cli.py", "tests/io/test_embedded_model.py"],
    "io/tokenizer/normalizers.py": ["tests/io/test_tokenizer_sentencepiece.py"],
    "io/tokenizer/unigram.py": ["tests/io/test_tokenizer_sentencepiece.py"],
    "io/tokenizer/spec.py": ["tests/io/test_tokenizer_sentencepiece.py"],
    "io/gguf/model.py": ["tests/io/test_gguf_import_families.py"],
    "algorithms/autoround.py": ["tests/algorithms/test_autoround.py"],
    "algorithms/gptq.py": ["tests/algorithms/test_algorithms.py"],
    "algorithms/gptq_solve.py": ["tests/algorithms/test_algorithms.py"],
    "algorithms/residual.py": ["tests/algorithms/test_residual.py"],
    "plan/prepared.py": ["tests/plan/test_plan.py"],
    "plan/disk.py": ["tests/plan/test_plan.py"],
    "plan/memory.py": ["tests/plan/test_plan.py", "tests/pipeline/test_streamed.py"],
    "loading/streamed.py": ["tests/pipeline/test_streamed.py"],
    "runtime/distributed.py": ["tests/pipeline/test_streamed.py"],
    "runtime/fsutil.py": ["tests/runtime/test_fsutil.py", "tests/export/test_export.py"],
    "io/gguf/importer.py": ["tests/io/test_gguf_tokenizer.py"],
    "export/consumers.py": ["tests/export/test_consumers.py"],
    "calib/recipes.py": ["tests/calib/test_quant_recipe.py"],
    "quant/spec.py": ["tests/calib/test_quant_recipe.py", "tests/quant/test_quant_formats.py"],
    "pipeline/chooser.py": [
        "tests/pipeline/test_chooser.py",
        "tests/cli/test_cli.py",
        "tests/contracts/test_readme.py",
    ],
    "pipeline/streamed.py": ["tests/pipeline/test_streamed.py"],
    "pipeline/calibrate.py": ["tests/pipeline/test_streamed.py", "tests/cli/test_cli.py"],
    "cli/commands.py": ["tests/runtime/test_distributed_plumbing.py", "tests/cli/test_cli.py"],
    "quant/fused.py": ["tests/quant/test_fused.py"],
    "data/divergence.py": ["tests/cli/test_cli.py"],
    "data/baseline.py": ["tests/cli/test_cli.py"],
    "cli/main.py": ["tests/cli/test_cli.py"],
    "models/published.py": ["tests/loading/test_published_fp8.py"],
    "algorithms/mappings.py": ["tests/algorithms/test_algorithms.py"],
    "layerwise/inputs.py": ["tests/layerwise/test_pass_through.py", "tests/pipeline/test_streamed.py"],
    "loading/build.py": ["tests/loading/test_foreign_models.py", "tests/pipeline/test_streamed.py"],
    "plan/source.py": ["tests/plan/test_plan.py", "tests/loading/test_published_fp8.py"],
    "data/chat.py": ["tests/io/test_chat_templates.py", "tests/data/test_sources.py"],
    "data/records.py": ["tests/data/test_sources.py", "tests/contracts/test_bad_inputs.py"],
    "data/sources.py": ["tests/data/test_sources.py", "tests/io/test_chat_templates.py"],
    "data/token_data.py": ["tests/data/test_sources.py", "tests/cli/test_cli.py"],
}

#: Modules only the catalogue mutates: their operator mutants are not part of ``--all``.
CATALOGUE_ONLY = {
    "data/perplexity.py",
    "io/tokenizer/normalizers.py",
    "io/tokenizer/unigram.py",
    "io/tokenizer/spec.py",
    "io/gguf/model.py",
    "algorithms/autoround.py",
    "algorithms/gptq.py",
    "algorithms/gptq_solve.py",
    "algorithms/residual.py",
    "plan/prepared.py",
    "plan/disk.py",
    "plan/memory.py",
    "loading/streamed.py",
    "runtime/distributed.py",
    "runtime/fsutil.py",
    "io/gguf/importer.py",
    "export/consumers.py",
    "pipeline/streamed.py",
    "pipeline/calibrate.py",
    "cli/commands.py",
    "quant/fused.py",
    "data/divergence.py",
    "data/baseline.py",
    "cli/main.py",
    "models/published.py",
    "algorithms/mappings.py",
    "layerwise/inputs.py",
    "loading/build.py",
    "plan/source.py",
    "data/chat.py",
    "data/records.py",
    "data/sources.py",
    "data/token_data.py",
}
#: Modules whose operators and constants ``--all`` mutates mechanically (besides the catalogue).
CORE = [m for m in TESTS if m not in CATALOGUE_ONLY]

_SWAPS = {
    "<": "<=", "<=": "<", ">": ">=", ">=": ">", "==": "!=", "!=": "==",
    "+": "-", "-": "+", "*": "/", "/": "*", "//": "/", "%": "//",
    "and": "or", "or": "and", "True": "False", "False": "True", "is": "is not", "in": "not in",
}  # fmt: skip


@dataclass
class Result:
    mutant: Mutant
    status: str  # "killed" | "survived" | "timeout" | "error"
    seconds: float
    detail: str = ""


def operator_mutants(module: str) -> list[Mutant]:
    """One mutant per operator, comparison, boolean constant and small integer literal of ``module``'s code."""
    path = ROOT / "src" / "shardcal" / module
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines(keepends=True)
    out = []
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(tokens):
        new = None
        if tok.type == tokenize.OP and tok.string in _SWAPS:
            new = _SWAPS[tok.string]
        elif tok.type == tokenize.NAME and tok.string in _SWAPS:
            if tok.string in ("is", "in") and i + 1 < len(tokens) and tokens[i + 1].string == "not":
                continue
            if tok.string == "in" and _in_for(tokens, i):
                continue
            new = _SWAPS[tok.string]
        elif tok.type == tokenize.NUMBER and tok.string.isdigit() and len(tok.string) <= 3:
            new = str(int(tok.string) + 1)
        if new is None:
            continue
        (row, col), (erow, ecol) = tok.start, tok.end
        if row != erow:
            continue
        line = lines[row - 1]
        mutated = line[:col] + new + line[ecol:]
        candidate = "".join(lines[: row - 1]) + mutated + "".join(lines[row:])
        try:
            compile(candidate, str(path), "exec")
        except SyntaxError:
            continue
        out.append(
            Mutant(
                f"op:{module}:{row}:{col}",
                module,
                line,
                mutated,
                f"line {row}: {tok.string!r} -> {new!r}",
                line=row,
            )
        )
    return out


def _in_for(tokens: list, i: int) -> bool:
    """Whether the ``in`` at ``tokens[i]`` belongs to a ``for`` (a loop or a comprehension) on its line."""
    row = tokens[i].start[0]
    j = i - 1
    while j >= 0 and tokens[j].start[0] == row:
        if tokens[j].string == "for":
            return True
        j -= 1
    return False


def apply(mutant: Mutant, tree: Path) -> str:
    """The mutated text of the mutant's module under ``tree`` (raises when the original text is not there once)."""
    path = tree / "src" / "shardcal" / mutant.module
    text = path.read_text(encoding="utf-8")
    if mutant.line is not None:
        lines = text.splitlines(keepends=True)
        if len(lines) < mutant.line or lines[mutant.line - 1] != mutant.old:
            raise ValueError(f"{mutant.id}: line {mutant.line} of src/shardcal/{mutant.module} has changed")
        lines[mutant.line - 1] = mutant.new
        return "".join(lines)
    count = text.count(mutant.old)
    if count != 1:
        raise ValueError(f"{mutant.id}: the original text occurs {count} times in src/shardcal/{mutant.module}")
    return text.replace(mutant.old, mutant.new, 1)


#: Not copied into the scratch tree: version control, environments, caches, build outputs.
_SKIP = (
    ".git",
    ".venv",
    "__pycache__",
    "*.pyc",
    ".pytest_cache",
    ".hypothesis",
    "*.egg-info",
    "build",
    "dist",
    "out",
    "runs",
)


def _copy_tree(target: Path, tests_dir: Path) -> None:
    """The repository (tests read docs/, the Makefile, benchmarks/) with ``tests_dir`` as its tests."""
    ignore = shutil.ignore_patterns(*_SKIP)
    shutil.copytree(ROOT, target, ignore=shutil.ignore_patterns(*_SKIP, "tests"), dirs_exist_ok=True)
    shutil.copytree(tests_dir, target / "tests", ignore=ignore)


def _run_tests(tree: Path, tests: list[str], timeout: float) -> tuple[str, float, str]:
    """Run ``tests`` in ``tree``; ("passed" | "failed" | "timeout", seconds, the output's tail)."""
    present = [t for t in tests if (tree / t.split("::")[0]).exists()]
    if not present:
        return "passed", 0.0, "no test files"
    env = dict(os.environ, PYTHONPATH=str(tree / "src"), PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", *present]
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=tree, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", time.monotonic() - start, (out or "")[-1500:]
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): take the test run and its ranks down too
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    seconds = time.monotonic() - start
    status = "passed" if proc.returncode == 0 else "failed"
    return status, seconds, (out or "")[-1500:]


def _failing_test(output: str) -> str:
    for line in output.splitlines():
        if line.startswith("FAILED ") or line.startswith("ERROR "):
            return line.split(" - ")[0]
    return output.strip().splitlines()[-1] if output.strip() else ""


def run(mutants: list[Mutant], tests_dir: Path, timeout: float, baseline: bool) -> list[Result]:
    results: list[Result] = []
    with tempfile.TemporaryDirectory(prefix="shardcal-mutation-") as scratch:
        tree = Path(scratch)
        _copy_tree(tree, tests_dir)
        checked: set[tuple[str, ...]] = set()
        for n, mutant in enumerate(mutants, 1):
            tests = TESTS[mutant.module] if mutant.tests is None else list(mutant.tests)
            key = tuple(tests)
            if baseline and key not in checked:
                status, seconds, out = _run_tests(tree, tests, timeout * 3)
                if status != "passed":
                    raise SystemExit(f"the unmutated code fails {' '.join(tests)} ({status}):\n{out}")
                print(f"baseline ok ({seconds:.0f}s): {' '.join(tests)}", flush=True)
                checked.add(key)
            path = tree / "src" / "shardcal" / mutant.module
            original = path.read_text(encoding="utf-8")
            try:
                path.write_text(apply(mutant, tree), encoding="utf-8")
            except ValueError as exc:
                results.append(Result(mutant, "error", 0.0, str(exc)))
                print(f"[{n}/{len(mutants)}] ERROR {mutant.id}: {exc}", flush=True)
                continue
            try:
                status, seconds, out = _run_tests(tree, tests, timeout)
            finally:
                path.write_text(original, encoding="utf-8")
            verdict = {"passed": "survived", "failed": "killed", "timeout": "timeout"}[status]
            results.append(Result(mutant, verdict, seconds, _failing_test(out) if verdict == "killed" else ""))
            mark = "SURVIVED" if verdict == "survived" else verdict
            print(f"[{n}/{len(mutants)}] {mark:8} {seconds:5.0f}s {mutant.id}: {mutant.description}", flush=True)
    return results


def write_results(results: list[Result], out: Path, command: str, tests_dir: Path) -> None:
    survived = [r for r in results if r.status == "survived"]
    harmless = [r for r in survived if r.mutant.harmless]
    killed = [r for r in results if r.status in ("killed", "timeout")]
    lines = [
        "# Mutation check: results",
        "",
        f"Written by `{command}` (tools/mutation.py) against the tests in `{tests_dir.relative_to(ROOT) if tests_dir.is_relative_to(ROOT) else tests_dir}`.",
        "Regenerate with `make mutation`; docs/design/testing.md explains the check and why the survivors are harmless.",
        "",
        f"- mutants: {len(results)}",
        f"- killed: {len(killed)} (of which timeouts: {sum(r.status == 'timeout' for r in results)})",
        f"- survived: {len(survived)} ({100 * len(survived) / max(len(results), 1):.1f} %), of which marked harmless: "
        f"{len(harmless)}",
        f"- errors (catalogue entry no longer applies): {sum(r.status == 'error' for r in results)}",
        f"- total test time: {sum(r.seconds for r in results) / 60:.1f} min",
        "",
        "| mutant | module | change | result | killed by / why harmless |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        why = (r.mutant.harmless if r.status == "survived" else r.detail) or ""
        change, why = (text.replace("|", "\\|") for text in (r.mutant.description, why))
        lines.append(f"| `{r.mutant.id}` | `{r.mutant.module}` | {change} | {r.status} | {why} |")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--all", action="store_true", help="also every operator/constant mutant of the core modules")
    parser.add_argument("--sample", type=int, default=None, help="with --all: this many operator mutants at random")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-catalogue", action="store_true", help="with --all: the operator mutants only")
    parser.add_argument("--only", action="append", default=[], help="run the mutant(s) with this id")
    parser.add_argument("--module", action="append", default=[], help="only mutants of this module (src/shardcal/...)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--check", action="store_true", help="check that every catalogue entry applies, and exit")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per mutant (a hang counts as killed)")
    parser.add_argument("--tests-dir", type=Path, default=ROOT / "tests")
    parser.add_argument("--out", type=Path, default=None, help="results file (default runs/mutation-results.md)")
    parser.add_argument("--no-baseline", action="store_true", help="skip running each test set unmutated first")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: the scratch copy is removed

    mutants = [] if args.all and args.skip_catalogue else list(CATALOGUE)
    if args.all:
        extra = [m for module in CORE for m in operator_mutants(module)]
        if args.sample is not None:
            extra = random.Random(args.seed).sample(extra, min(args.sample, len(extra)))
        mutants += extra
    if args.only:
        wanted = set(args.only)
        mutants = [m for m in mutants if m.id in wanted]
        if len(mutants) != len(wanted):
            raise SystemExit(f"unknown mutant id(s): {sorted(wanted - {m.id for m in mutants})}")
    if args.module:
        mutants = [m for m in mutants if m.module in args.module]
    if args.check:
        bad = []
        for m in CATALOGUE:
            try:
                text = apply(m, ROOT)
                compile(text, m.module, "exec")
            except (ValueError, SyntaxError) as exc:
                bad.append(f"{m.id}: {exc}")
            if m.module not in TESTS:
                bad.append(f"{m.id}: no tests mapped to {m.module}")
        print("\n".join(bad) or f"{len(CATALOGUE)} catalogue entries apply")
        return 1 if bad else 0
    if args.list:
        for m in mutants:
            print(f"{m.id:40} {m.module:24} {m.description}{'  [harmless]' if m.harmless else ''}")
        return 0

    results = run(mutants, args.tests_dir.resolve(), args.timeout, not args.no_baseline)
    survived = [r for r in results if r.status == "survived"]
    print(f"\n{len(results)} mutants: {len(results) - len(survived)} killed, {len(survived)} survived")
    for r in survived:
        print(
            f"  survivor {r.mutant.id}: {r.mutant.description}"
            + (f"  [harmless: {r.mutant.harmless}]" if r.mutant.harmless else "")
        )
    if (not args.only and not args.module) or args.out is not None:
        out = args.out if args.out is not None else ROOT / "runs" / "mutation-results.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        write_results(
            results, out, "python tools/mutation.py " + " ".join(argv or sys.argv[1:]), args.tests_dir.resolve()
        )
        print(f"results: {out}")
    unexpected = [r for r in survived if not r.mutant.harmless]
    return 1 if unexpected else 0


if __name__ == "__main__":
    sys.exit(main())

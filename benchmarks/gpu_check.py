"""The prepared GPU check: one command, a few minutes on one GPU, one table. CI never has a GPU; run it on a lent one.

    PYTHONPATH=src python benchmarks/gpu_check.py [--device cuda] [--layers 2] [--samples 32] [--seq-len 512]
    PYTHONPATH=src python benchmarks/gpu_check.py --smoke --device cpu      # the same code path, tiny, on CPU
    PYTHONPATH=src python benchmarks/gpu_check.py --table [--results-dir DIR]   # also write the results table

Everything is built from seeds (nothing is downloaded; no checkpoint travels with the tree):

1. **CUDA vs CPU**: a small random Llama calibrated (w8a8-int8, max observers) on the device and on the CPU from
   the same seed and the same tokens; the largest relative difference of any quantizer's amax (float32 kernels
   differ between devices, so this is a tolerance, not bit-equality).
2. **Llama-3-8B widths**: a random checkpoint with Llama-3-8B's shapes and ``--layers`` decoder layers, in
   bfloat16, loaded with ``load_pretrained`` (the default group: ``cpu:gloo,cuda:nccl``; world size 1), calibrated
   with fp8 with the activation cache offloaded to host memory: calibration time / one plain forward over the same
   data, peak device memory (``torch.cuda.max_memory_allocated``) beside what ``shardcal.plan.planner`` predicted for the
   same run from the config and headers, then the export, its size, and the reloaded export's logits against the
   fake-quant model's.

Prints one table; exits non-zero when a check fails (amax difference above 1e-3, reload logits not equal, the
measured peak outside -20 % / +25 % of the planner's prediction). ``--json FILE`` writes the raw results;
``--table`` also writes them as ``docs/results/gpu_check.json`` (benchmarks/_results.py; a ``--smoke`` run or
another ``--device`` than cuda writes only with ``--results-dir DIR``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from _results import ORDER, RATIO_COLUMNS, ratio_row, save_table  # this folder

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

LLAMA3_8B = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
SMALL = {**LLAMA3_8B, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 8,
         "num_key_value_heads": 4, "num_hidden_layers": 4, "torch_dtype": "float32"}  # fmt: skip
SMOKE_WIDE = {**LLAMA3_8B, "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
              "num_key_value_heads": 2}  # fmt: skip


def _random_model(cfg: dict, seed: int) -> torch.nn.Module:
    from shardcal.models import CausalLM, ModelConfig

    torch.manual_seed(seed)
    model = CausalLM(ModelConfig.from_dict(cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.02)
    return model.eval()


def _amax(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    from shardcal.quant.session import iter_quantizers

    return {n: q.amax.detach().float().cpu() for n, q in iter_quantizers(model) if q.amax is not None}


def check_devices(device: str, data: torch.Tensor) -> dict:
    """Section 1: the same seed and tokens calibrated on ``device`` and on the CPU."""
    from shardcal.calib.runner import calibrate

    results = {}
    for where in ("cpu", device):
        model = _random_model(SMALL, seed=0).to(where)
        calibrate(model, data % SMALL["vocab_size"], "w8a8-int8", batch_size=4, progress=False)
        results[where] = _amax(model)
    cpu, dev = results["cpu"], results[device]
    worst = max(((a - cpu[n]).abs().max() / cpu[n].abs().max().clamp(min=1e-12)).item() for n, a in dev.items())
    return {"quantizers": len(dev), "max_rel_amax_diff": worst, "ok": dev.keys() == cpu.keys() and worst <= 1e-3}


def _write_checkpoint(cfg: dict, folder: Path) -> Path:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    model = _random_model({**cfg, "torch_dtype": "float32"}, seed=1).to(torch.bfloat16)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _plain_forward_seconds(model: torch.nn.Module, data: torch.Tensor, batch_size: int, device: str) -> float:
    with torch.no_grad():
        model(data[:1, :16].to(device))  # warm-up
        _sync(device)
        start = time.perf_counter()
        for s in range(0, data.shape[0], batch_size):
            model(data[s : s + batch_size].to(device))
        _sync(device)
    return time.perf_counter() - start


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_mb(device: str) -> float | None:
    return torch.cuda.max_memory_allocated() / 2**20 if device.startswith("cuda") else None


def _predicted_peak(model_dir: Path, data: torch.Tensor, batch_size: int, device: str) -> int:
    """The planner's device peak for the calibration alone (embedding and layers; one rank, activations offloaded)."""
    from shardcal.layerwise.options import CalibrationOptions
    from shardcal.plan.planner import PlanSettings, plan_calibration

    options = CalibrationOptions(batch_size=batch_size, offload_activations=True)
    settings = PlanSettings(
        num_samples=data.shape[0], seq_len=data.shape[1], device=device.split(":")[0], options=options
    )
    rank = plan_calibration(model_dir, "fp8", settings, dtype="bfloat16").ranks[0]
    return max(rank.phases["embed"], rank.phases["layers"])


def check_wide(device: str, cfg: dict, data: torch.Tensor, batch_size: int, workdir: Path) -> dict:
    """Section 2: Llama-3-8B widths, bf16, sharded load, fp8 with offloaded activations, export and reload."""
    from shardcal.calib.runner import calibrate
    from shardcal.export import export_checkpoint
    from shardcal.loading.plain import from_pretrained
    from shardcal.loading.sharded import load_pretrained

    start = time.perf_counter()
    model_dir = _write_checkpoint(cfg, workdir / "wide")
    write_s = time.perf_counter() - start
    predicted = _predicted_peak(model_dir, data, batch_size, device)
    model = load_pretrained(model_dir, dtype="bfloat16")
    t_forward = _plain_forward_seconds(model, data, batch_size, device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    report = calibrate(model, data, "fp8", batch_size=batch_size, offload_activations=True, progress=False)
    _sync(device)
    t_calibrate = time.perf_counter() - start
    peak = _peak_mb(device)
    start = time.perf_counter()
    out = export_checkpoint(model, workdir / "wide-fp8", recipe="fp8", report=report)
    t_export = time.perf_counter() - start
    probe = data[:2].to(device)
    with torch.no_grad():
        want = model(probe).float().cpu()
    del model
    reloaded = from_pretrained(out, device=device)
    with torch.no_grad():
        got = reloaded(probe).float().cpu()
    export_bytes = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    source_bytes = (model_dir / "model.safetensors").stat().st_size
    return {
        "layers": cfg["num_hidden_layers"],
        "write_checkpoint_s": write_s,
        "forward_s": t_forward,
        "calibrate_s": t_calibrate,
        "ratio": t_calibrate / t_forward,
        "peak_device_mb": peak,
        "predicted_peak_mb": predicted / 2**20,
        "plan_error": None if peak is None else peak / (predicted / 2**20) - 1,
        "export_s": t_export,
        "export_mb": export_bytes / 2**20,
        "source_mb": source_bytes / 2**20,
        "mean_sqnr_db": report.mean_sqnr_db,
        "reload_max_abs_diff": (got - want).abs().max().item(),
        "ok": torch.equal(got, want),
    }


def gpu_table(devices: dict, big: dict, *, device: str, samples: int, seq_len: int, batch_size: int) -> dict:
    """The table of a run (``write_table``'s keywords) from ``check_devices``' and ``check_wide``'s results."""
    peak = big["peak_device_mb"]  # None on a CPU
    rows = [
        ratio_row(f"quantizer amax on {device}, largest relative difference", devices["max_rel_amax_diff"], "",
                  "the same on the CPU", None, "<= 1e-3", digits=8),
        ratio_row("fp8 calibration, activations offloaded", big["calibrate_s"], "s", "one plain forward",
                  big["forward_s"], digits=2),
        ratio_row("peak device memory during calibration", peak, "MB",
                  "planner's prediction", big["predicted_peak_mb"], "0.80 - 1.25", digits=0),
        ratio_row("export size", big["export_mb"], "MB", "bfloat16 source", big["source_mb"]),
        ratio_row("export time", big["export_s"], "s", digits=1),
        ratio_row("reloaded export against fake-quant logits, largest |difference|", big["reload_max_abs_diff"], "",
                  target="0 (equal)", digits=8),
        ratio_row("mean layer output SQNR", big["mean_sqnr_db"], "dB"),
    ]  # fmt: skip
    return {
        "title": f"GPU check on {device}: against the CPU, and Llama-3-8B widths",
        "columns": RATIO_COLUMNS,
        "rows": rows,
        "notes": [
            f"1. A small random Llama calibrated (w8a8-int8, max observers) on {device} and on the CPU from the same "
            f"seed and tokens ({devices['quantizers']} quantizers); float32 kernels differ between devices, so the "
            "amax difference is held to a tolerance, not bit-equality.",
            f"2. A random checkpoint with Llama-3-8B's widths and {big['layers']} decoder layers, bfloat16, loaded "
            f"with load_pretrained (world size 1), calibrated with fp8 on {samples} x {seq_len} tokens (batch "
            f"{batch_size}) with the activation cache offloaded to host memory; the peak is "
            "torch.cuda.max_memory_allocated against shardcal.plan.planner's prediction for the same run; then the "
            "export, its size, and the reloaded export's logits against the fake-quant model's.",
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers of the Llama-3-8B-width model")
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--smoke", action="store_true", help="tiny widths and data: the code path only")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--table", action="store_true", help="also write the results table (docs/results/)")
    parser.add_argument("--results-dir", type=Path, default=None, help="with --table: write it here instead")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("error: --device cuda but torch sees no GPU (use --device cpu for the code path)", file=sys.stderr)
        return 2
    from shardcal.runtime.distributed import backend_name, init_distributed

    init_distributed()
    samples, seq_len = (4, 32) if args.smoke else (args.samples, args.seq_len)
    wide = dict(SMOKE_WIDE if args.smoke else LLAMA3_8B, num_hidden_layers=args.layers)
    data = torch.randint(0, wide["vocab_size"], (samples, seq_len), generator=torch.Generator().manual_seed(0))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR")) as tmp:
        devices = check_devices(args.device, data[:, :64])
        big = check_wide(args.device, wide, data, args.batch_size, Path(tmp))
    total = time.perf_counter() - t0
    name = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    rows = [
        ("device / torch / group backend", f"{name} / {torch.__version__} / {backend_name()}"),
        (f"1. amax, {args.device} vs cpu ({devices['quantizers']} quantizers)", f"max rel diff {devices['max_rel_amax_diff']:.2e}"),
        (f"2. model: Llama-3-8B widths{' (smoke)' if args.smoke else ''}, {big['layers']} layers, bf16", f"{samples} x {seq_len} tokens"),
        ("   one plain forward / fp8 calibration", f"{big['forward_s']:.2f} s / {big['calibrate_s']:.2f} s = {big['ratio']:.2f}"),
        ("   peak device memory during calibration", "n/a (cpu)" if big["peak_device_mb"] is None else f"{big['peak_device_mb']:.0f} MB"),
        ("   planner's predicted peak (shardcal plan)", f"{big['predicted_peak_mb']:.0f} MB" + ("" if big["plan_error"] is None else f", measured {100 * big['plan_error']:+.1f}%")),
        ("   mean layer output SQNR", f"{big['mean_sqnr_db']:.1f} dB" if big["mean_sqnr_db"] is not None else "n/a"),
        ("   export (time, size vs bf16 source)", f"{big['export_s']:.1f} s, {big['export_mb']:.0f} MB vs {big['source_mb']:.0f} MB"),
        ("   reloaded export vs fake-quant logits", f"max |diff| {big['reload_max_abs_diff']:.3g} ({'equal' if big['ok'] else 'DIFFERENT'})"),
        ("total wall time", f"{total:.0f} s"),
    ]  # fmt: skip
    width = max(len(r[0]) for r in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")
    if args.json:
        Path(args.json).write_text(json.dumps({"devices": devices, "wide": big, "seconds": total}, indent=1))
    if args.table:
        why = "--smoke" if args.smoke else None if args.device.startswith("cuda") else f"--device {args.device}"
        save_table(
            argparse.Namespace(no_save=False, results_dir=args.results_dir),
            "gpu_check",
            off_reference=why,
            order=ORDER["gpu"],
            **gpu_table(devices, big, device=name, samples=samples, seq_len=seq_len, batch_size=args.batch_size),
        )
    planned = big["plan_error"] is None or -0.20 <= big["plan_error"] <= 0.25
    return 0 if devices["ok"] and big["ok"] and planned else 1


if __name__ == "__main__":
    raise SystemExit(main())

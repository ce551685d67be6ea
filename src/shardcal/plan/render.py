"""The plan as text: the table ``shardcal plan`` prints, the growth line beside it, and byte counts as short human
figures."""

from __future__ import annotations

from .calibration_plan import CalibrationPlan

PART_LABELS = {
    "param_shards": "parameter shards",
    "largest_gathered_unit": "largest gathered unit",
    "activation_cache": "activation cache (inputs + outputs)",
    "layer_intermediates": "one batch's intermediates",
    "quantizer_state": "quantizer / observer state",
    "weight_observer": "weight-scale calibration",
    "algorithm_state": "algorithm state",
    "export_buffers": "export buffers",
    "checkpoint_pages": "checkpoint pages while loading",
    "runtime": "runtime allowance",
}


def fmt_bytes(n: float) -> str:
    """``n`` bytes as a short human figure (binary units: KiB, MiB, GiB, TiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def growth_line(plan: CalibrationPlan, baseline: int | None) -> str:
    """What the PEAK row means, in MiB: the predicted growth over a rank's size after imports, and the process peak
    that makes with ``baseline`` (bytes; the resident size after imports, measured by the caller; None: unknown) —
    the two figures ``shardcal calibrate`` reports as measured."""
    growth = plan.peak_bytes_per_rank / 2**20
    where = "device" if plan.settings.device != "cpu" else "host"
    line = f"predicted growth per rank {growth:.1f} MiB ({where} memory over the process's size after imports)"
    if baseline is None or plan.settings.device != "cpu":
        return line
    base = baseline / 2**20
    return line + f"; process peak ≈ {growth:.1f} + baseline {base:.1f} = {growth + base:.1f} MiB"


def format_plan(plan: CalibrationPlan, max_ranks: int = 4, baseline: int | None = None) -> str:
    """The human-readable plan ``shardcal plan`` prints: parts and phases per rank, traffic, disk, time.
    ``baseline``: the resident size after imports (bytes) that :func:`growth_line` adds to the PEAK."""
    shown = plan.ranks if len(plan.ranks) <= max_ranks else [plan.ranks[0], plan.peak_rank]
    shown = list({r.rank: r for r in shown}.values())
    lines = [*_heading(plan), *_memory_rows(plan, shown), growth_line(plan, baseline), "", *_io_lines(plan)]
    if len(plan.ranks) > len(shown):
        lines.append(f"(ranks shown: the first and the peak of {len(plan.ranks)})")
    if plan.time is not None:
        t = plan.time
        lines.append(
            f"time: about {t['calibrate_seconds']:.0f} s to calibrate ({t['layer_seconds']:.2f} s per layer: "
            f"{t['fixed_seconds']:.2f} s + {t['batch_seconds']:.3f} s x {t['batches_per_rank']} batch(es) per rank; "
            f"{t['cpu_seconds_per_rank']:.0f} CPU-seconds per rank; probed on {t['probe_device']}, "
            f"{t['probe_threads']} thread(s))"
        )
    return "\n".join(lines)


def _heading(plan: CalibrationPlan) -> list[str]:
    s, m = plan.settings, plan.model
    cache = "host" if s.offload_activations or s.device == "cpu" else "device"
    return [
        f"{m['model_type']}, {m['layers']} layers, {m['parameters'] / 1e9:.3g}B parameters "
        f"({fmt_bytes(m['parameter_bytes'])} in {m['dtype']}; from {m['source']})",
        f"recipe {plan.recipe} (algorithm {plan.algorithm}); {s.world_size} rank(s) on {s.device}"
        f"{' with --cpu-offload' if s.cpu_offload else ''}; {s.num_samples} x {s.seq_len} tokens, batch "
        f"{s.options.batch_size}; activation cache in {cache} memory",
        "",
    ]


def _memory_rows(plan: CalibrationPlan, shown: list) -> list[str]:
    s = plan.settings
    row = lambda label, values: f"{label:38}" + "".join(f"{fmt_bytes(v):>13}" for v in values)
    lines = [f"{'per rank':38}" + "".join(f"{'rank ' + str(r.rank):>13}" for r in shown)]
    lines += [row(f"  {label}", [r.parts[key] for r in shown]) for key, label in PART_LABELS.items()]
    where = "device" if s.device != "cpu" else "host"
    for phase in [p for p in ("load", "rotate", "embed", "layers", "export") if p in shown[0].phases]:
        lines.append(row(f"  {where} peak while {phase}", [r.phases[phase] for r in shown]))
    lines.append(row("PEAK", [r.peak for r in shown]))
    if s.device != "cpu":
        lines.append(row("host peak (activations, pages)", [r.host_peak for r in shown]))
    lines.append(row("bytes read from disk", [r.bytes_read for r in shown]))
    return lines


def _io_lines(plan: CalibrationPlan) -> list[str]:
    io, disk = plan.io, plan.disk
    return [
        f"all-gather per layer: {fmt_bytes(io['allgather_bytes_per_layer'])} gathered, "
        f"{fmt_bytes(io['allgather_sent_per_layer_per_rank'])} sent by each rank "
        f"({fmt_bytes(io['allgather_sent_total_per_rank'])} over the run)",
        f"all-reduce per layer: {fmt_bytes(io['allreduce_bytes_per_layer'])} of statistics",
        f"disk: export {fmt_bytes(disk['export_bytes'])} in {disk['export_files']} file(s); "
        f"--checkpoint-dir needs up to {fmt_bytes(disk['checkpoint_dir_bytes'])}",
    ]

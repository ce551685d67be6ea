"""Failures injected at the package's fault points (``shardcal.runtime.faults``), shared by the tests."""

from __future__ import annotations

from shardcal.runtime.faults import armed


class CalibrationInterrupted(RuntimeError):
    """Raised at the ``calibrate.committed`` fault point."""


class ExportInterrupted(RuntimeError):
    """Raised at the ``export.unit`` fault point."""


def interrupt_after(layers: int | None):
    """Stop a calibration once the checkpoint of ``layers`` completed layers is committed (None: never)."""

    def stop(completed_layers: int) -> None:
        if completed_layers == layers:
            raise CalibrationInterrupted(f"interrupted after {completed_layers} layers (injected)")

    return armed("calibrate.committed", stop)


def fail_export_at(index: int):
    """Fail an export on the rank that owns unit ``index``, before it writes it."""

    def fail(unit: int, unit_name: str) -> None:
        if unit == index:
            raise ExportInterrupted(f"export interrupted at unit {unit} ({unit_name}) (injected)")

    return armed("export.unit", fail)

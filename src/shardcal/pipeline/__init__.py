"""Library calls that do what a ``shardcal`` command does: :func:`~.calibrate.calibrate_to_checkpoint` (``shardcal calibrate``), with the checks before loading and the data reading it shares with the command line (:mod:`.inputs`).

Every function here is collective where it says so (each rank calls it, under torchrun or
:func:`shardcal.runtime.launcher.launch`); errors are :class:`~shardcal.errors.ShardcalError` naming the input.
"""

from .calibrate import PipelineResult, calibrate_to_checkpoint
from .inputs import CalibrationInputs, check_calibration_inputs, read_token_data

__all__ = [
    "CalibrationInputs",
    "PipelineResult",
    "calibrate_to_checkpoint",
    "check_calibration_inputs",
    "read_token_data",
]

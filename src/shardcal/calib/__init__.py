"""Calibration: recipes (:mod:`.recipes`), the runner ``calibrate`` (:mod:`.runner`), its report (:mod:`.report`)
and its resumable checkpoint (:mod:`.calibration_checkpoint`)."""

"""Calibration: recipes (:mod:`.recipes`) and their quantizers put on modules (:mod:`.attach`), the runner
``calibrate`` (:mod:`.runner`), its report (:mod:`.report`) and its resumable checkpoint (:mod:`.calibration_checkpoint`)."""

"""The layer-by-layer scaffold: user data into batches (:mod:`.batches`), what each decoder layer is called with
(:mod:`.inputs`), the ``layer_steps`` primitive (:mod:`.steps`), MoE all-experts observation (:mod:`.moe`) and the
run's options (:mod:`.options`, ``CalibrationOptions``)."""

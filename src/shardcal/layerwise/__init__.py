"""The layer-by-layer scaffold: user data into batches (:mod:`.batches`), what each decoder layer is called with
(:mod:`.inputs`), the ``layer_steps`` primitive (:mod:`.steps`), MoE all-experts observation (:mod:`.moe`), the
run's options (:mod:`.options`, ``CalibrationOptions``), and what both runners share to be resumable: the checkpoint
directory (:mod:`.layer_checkpoint`), resuming (:mod:`.resume`) and the progress bar (:mod:`.progress`)."""

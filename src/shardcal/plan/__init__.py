"""Before loading: the recipe checked against the model's meta-device skeleton (:mod:`.preflight`), the per-rank
memory, traffic, disk and time planner and the refusal before an OOM (:mod:`.planner`), and its time probe
(:mod:`.probe`)."""

"""Where a model keeps its decoder layers (:mod:`.registry`, ``LayerActivationCollector``) and FSDP2 for layer-wise
use (:mod:`.fsdp2`: ``fsdp2_wrap``, ``fsdp2_root_unsharded``, one gather per layer, edits written back to shards)."""

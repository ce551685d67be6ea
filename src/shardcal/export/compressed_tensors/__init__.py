"""The compressed-tensors format: its vocabulary (:mod:`.config`), one Linear's tensors (:mod:`.tensors`) and the export format object (:mod:`.format`).

Reload lives in :mod:`shardcal.loading.quantized`, which reads the same vocabulary and tensor layouts.
"""

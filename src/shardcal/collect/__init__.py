"""Activation collection: target patterns (:mod:`.targets`), per-channel statistics (:mod:`.stats`), the report
(:mod:`.report`), raw activations on disk and ``ActivationDataset`` (:mod:`.store`), what calibration reuses of a
report (:mod:`.feed`), the resumable checkpoint (:mod:`.collection_checkpoint`), the options (:mod:`.options`,
``CollectionOptions``) and ``collect_activations`` (:mod:`.runner`)."""

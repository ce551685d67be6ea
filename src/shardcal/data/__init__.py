"""Calibration and evaluation data (:mod:`.token_data`: token ids from files or text, the Wikipedia summaries),
perplexity (:mod:`.perplexity`), the KL divergence from a source model (:mod:`.divergence`) and the source's cached
side (:mod:`.baseline`)."""

"""Calibration and evaluation data (:mod:`.token_data`: token ids from files or text, the Wikipedia summaries)
and perplexity (:mod:`.perplexity`)."""

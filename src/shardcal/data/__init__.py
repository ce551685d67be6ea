"""Calibration and evaluation data (:mod:`.calibration`: token ids from files or text, the Wikipedia summaries)
and perplexity (:mod:`.perplexity`)."""

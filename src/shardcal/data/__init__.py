"""Calibration and evaluation data (:mod:`.token_data`: token ids from files or text, the Wikipedia summaries;
:mod:`.sources`: records of text, conversations or token ids from JSONL and parquet (:mod:`.records`), rendered with
the model's chat template (:mod:`.chat`), several sources mixed), perplexity (:mod:`.perplexity`), the KL divergence
from a source model (:mod:`.divergence`) and the source's cached side (:mod:`.baseline`)."""

"""Reading and writing formats beside the model checkpoint: GGUF import (:mod:`.gguf`) and the byte-level BPE
tokenizer (:mod:`.tokenizer`)."""

"""Reading and writing formats beside the model checkpoint: GGUF import (:mod:`.gguf`) and the tokenizer.json
reader (the package :mod:`.tokenizer`, one module per part of the file)."""

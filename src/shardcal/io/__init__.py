"""Reading and writing formats beside the model checkpoint: GGUF import (:mod:`.gguf`) and the tokenizer.json
reader (:mod:`.tokenizer`, with one module per part of the file: ``tokenizer_added``, ``tokenizer_normalizers``,
``tokenizer_pretokenizers``, ``tokenizer_bpe``, ``tokenizer_unigram``, ``tokenizer_post``, ``tokenizer_decoders``)."""

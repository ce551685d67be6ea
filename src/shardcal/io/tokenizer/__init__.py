"""The tokenizer.json reader in plain Python: :class:`Tokenizer` (:mod:`.tokenizer`), one module per part of the
file (:mod:`.added_tokens`, :mod:`.normalizers`, :mod:`.pretokenizers`, :mod:`.bpe`, :mod:`.unigram`,
:mod:`.post_processors`, :mod:`.decoders`) and typed field access (:mod:`.spec`)."""

from .pretokenizers import bytes_to_unicode
from .tokenizer import Tokenizer, check_tokenizer_file

__all__ = ["Tokenizer", "bytes_to_unicode", "check_tokenizer_file"]

"""GGUF import (llama.cpp's format -> a Hugging Face-format model directory): reading the file (:mod:`.reader`), its
model as HF's config and tensors (:mod:`.model`), its vocabulary as tokenizer.json (:mod:`.tokenizer`), and the
import itself with its cache and the embedded demo model (:mod:`.importer`, whose docstring says what differs)."""

from .importer import (
    IMPORT_DTYPES,
    default_cache_dir,
    embedded_gguf_path,
    embedded_model_dir,
    import_gguf,
    import_gguf_cached,
    is_valid_import,
)
from .model import SUPPORTED_ARCHITECTURES, permute_qk, unpermute_qk
from .reader import GGUFFile, GGUFTensor, read_gguf
from .tokenizer import tokenizer_json

__all__ = [
    "IMPORT_DTYPES",
    "SUPPORTED_ARCHITECTURES",
    "GGUFFile",
    "GGUFTensor",
    "default_cache_dir",
    "embedded_gguf_path",
    "embedded_model_dir",
    "import_gguf",
    "import_gguf_cached",
    "is_valid_import",
    "permute_qk",
    "read_gguf",
    "tokenizer_json",
    "unpermute_qk",
]

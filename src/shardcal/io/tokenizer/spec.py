"""Reading the parts of a tokenizer.json: typed field access whose every failure is a :class:`TokenizerError`.

Shared by the tokenizer's component modules (normalizers, pre-tokenizers, models, decoders, post-processors).
"""

from __future__ import annotations

from typing import Any, NoReturn

from ...errors import TokenizerError

#: The characters Rust's ``char::is_whitespace`` accepts (Unicode White_Space), which ``tokenizers`` uses for
#: Strip, WhitespaceSplit and the lstrip/rstrip of added tokens. Python's ``str.isspace`` also accepts U+001C-U+001F.
WHITESPACE = (
    "\t\n\v\f\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006\u2007\u2008\u2009\u200a"
    "\u2028\u2029\u202f\u205f\u3000"
)
#: :data:`WHITESPACE` as a regex character class body.
WHITESPACE_CLASS = "".join(f"\\u{ord(c):04x}" for c in WHITESPACE)


def regex_module() -> Any:
    """The ``regex`` package (``\\p{L}``-style classes), or a TokenizerError saying how to install it."""
    try:
        import regex
    except ImportError:
        raise TokenizerError("the tokenizer needs the package 'regex': pip install regex") from None
    return regex


class Spec:
    """The source file of a tokenizer.json, for error messages, and checked access to its JSON fields."""

    def __init__(self, source: str):
        self.source = source
        self.re = regex_module()

    def fail(self, message: str) -> NoReturn:
        """Raise a TokenizerError naming the file."""
        raise TokenizerError(f"{self.source}: {message}")

    def unsupported(self, where: str, what: str, kind: Any, supported: list[str]) -> NoReturn:
        """Raise the error for an unknown component ``type``."""
        self.fail(f"field '{where}': {what} type {kind!r} is not supported (supported: {', '.join(supported)})")

    def obj(self, value: Any, where: str) -> dict[str, Any]:
        """``value`` as a JSON object."""
        if not isinstance(value, dict):
            self.fail(f"field '{where}' must be an object, got {type(value).__name__}")
        return value

    def kind(self, spec: Any, where: str) -> Any:
        """The ``type`` of a component object."""
        return self.obj(spec, where).get("type")

    def items(self, spec: dict[str, Any], key: str, where: str) -> list[Any]:
        """A list-valued field (required)."""
        value = spec.get(key)
        if not isinstance(value, list):
            self.fail(f"field '{where}.{key}' must be a list")
        return value

    def flag(self, spec: dict[str, Any], key: str, where: str, default: bool) -> bool:
        """A boolean field; absent or null gives ``default``."""
        value = spec.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            self.fail(f"field '{where}.{key}' must be true or false, got {value!r}")
        return value

    def text(self, spec: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
        """A string field; absent or null gives ``default`` (an error when ``default`` is None)."""
        value = spec.get(key)
        if value is None and default is not None:
            return default
        if not isinstance(value, str):
            self.fail(f"field '{where}.{key}' must be a string, got {value!r}")
        return value

    def char(self, spec: dict[str, Any], key: str, where: str) -> str:
        """A field holding exactly one character."""
        value = self.text(spec, key, where)
        if len(value) != 1:
            self.fail(f"field '{where}.{key}' must be a single character, got {value!r}")
        return value

    def count(self, spec: dict[str, Any], key: str, where: str, default: int | None = None) -> int:
        """A non-negative integer field; absent or null gives ``default`` (an error when None)."""
        value = spec.get(key)
        if value is None and default is not None:
            return default
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            self.fail(f"field '{where}.{key}' must be a non-negative integer, got {value!r}")
        return value

    def pattern(self, spec: dict[str, Any], where: str) -> Any:
        """A compiled ``{"String": ...}`` / ``{"Regex": ...}`` pattern (``tokenizers`` escapes a String)."""
        pattern = spec.get("pattern")
        if isinstance(pattern, dict) and isinstance(pattern.get("Regex"), str):
            source = pattern["Regex"]
        elif isinstance(pattern, dict) and isinstance(pattern.get("String"), str):
            source = self.re.escape(pattern["String"])
        else:
            self.fail(f'field \'{where}.pattern\' must be {{"Regex": ...}} or {{"String": ...}}')
        try:
            return self.re.compile(source)
        except Exception as exc:
            self.fail(f"field '{where}.pattern' is not a valid regex ({exc})")


def utf8(text: str) -> bytes:
    """UTF-8 bytes of ``text``, lone surrogates included (as Python strings may hold them)."""
    return text.encode("utf-8", errors="surrogatepass")


def byte_token(byte: int) -> str:
    """The byte-fallback token of a byte value, as ``tokenizers`` spells it: ``<0x0A>``."""
    return f"<0x{byte:02X}>"


def metaspace_settings(spec: Spec, value: dict[str, Any], where: str) -> tuple[str, str]:
    """A Metaspace component's ``(replacement, prepend_scheme)`` (the pre-tokenizer's and the decoder's alike):
    without ``prepend_scheme``, the older ``add_prefix_space`` decides ("always" unless it is false)."""
    rep = spec.char(value, "replacement", where)
    scheme = value.get("prepend_scheme")
    if scheme is None:
        scheme = "never" if value.get("add_prefix_space") is False else "always"
    if scheme not in ("always", "first", "never"):
        spec.fail(f"field '{where}.prepend_scheme' must be 'always', 'first' or 'never', got {scheme!r}")
    return rep, scheme

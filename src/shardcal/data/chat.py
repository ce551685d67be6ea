"""Chat conversations rendered with the model's own chat template, as transformers' ``apply_chat_template`` renders
them (a sandboxed Jinja environment with the same options, filters and globals; ``jinja2`` is the optional extra
``shardcal[data]``, transformers is not needed).

The template is looked for where transformers looks: a ``chat_template.jinja`` file in the model directory, then
``chat_template.json``, then the ``chat_template`` field of ``tokenizer_config.json`` (a string, or a list of named
templates of which ``default`` is taken); a user's own file overrides all of them. A conversation is rendered without
a generation prompt (calibration data are whole conversations), with the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables, and its ``tools`` (when the record has them) passed as transformers passes them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from ..errors import DataError
from ..runtime.fsutil import read_json_object

#: Where a model directory keeps its chat template, in the order transformers reads them.
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_JSON = "chat_template.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
#: The special-token names of a tokenizer configuration that templates read as variables.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
#: The names a message's reasoning goes by; templates read ``reasoning_content`` (and GPT-OSS's ``thinking``).
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
JINJA_HINT = "pip install 'shardcal[data]' (jinja2 >= 3.1.6)"


@dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A chat template's source text, where it came from and the special tokens it is rendered with."""

    source: str
    origin: str
    special_tokens: Mapping[str, str]

    def render(self, messages: Sequence[Mapping[str, Any]], tools: Sequence[Any] | None = None) -> str:
        """The conversation as text: the template rendered with ``messages``, ``tools``, no generation prompt and
        the special tokens. A template error (``raise_exception`` or a Jinja error) is a :class:`ValueError`
        carrying the template's message; the caller names the record."""
        import jinja2

        compiled = _compile(self.source, self.origin)
        try:
            return compiled.render(
                messages=[_with_reasoning_aliases(message) for message in messages],
                tools=None if tools is None else list(tools),
                documents=None,
                add_generation_prompt=False,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"the chat template ({self.origin}) fails: {exc}") from None
        except Exception as exc:  # whatever else a template's expressions raise (it is the user's data's fault)
            raise ValueError(f"the chat template ({self.origin}) fails on it: {type(exc).__name__}: {exc}") from None


def load_chat_template(model_dir: str | Path, override: str | Path | None = None) -> ChatTemplate:
    """The chat template for ``model_dir``: ``override`` (a Jinja file) when given, else the model directory's own.
    A :class:`~shardcal.errors.DataError` names what is missing or unreadable, and the template is compiled here,
    so that a syntax error fails before any data is read."""
    model_dir = Path(model_dir)
    if override is not None:
        source, origin = _read_template_file(Path(override)), str(override)
    else:
        source, origin = _template_of(model_dir)
    template = ChatTemplate(source=source, origin=origin, special_tokens=_special_tokens(model_dir))
    _compile(template.source, template.origin)
    return template


def _template_of(model_dir: Path) -> tuple[str, str]:
    jinja_file = model_dir / TEMPLATE_FILE
    if jinja_file.is_file():
        return _read_template_file(jinja_file), str(jinja_file)
    for name in (TEMPLATE_JSON, TOKENIZER_CONFIG):
        path = model_dir / name
        if not path.is_file():
            continue
        template = _template_field(read_json_object(path, DataError), path)
        if template is not None:
            return template, f"{path}: chat_template"
    raise DataError(
        f"{model_dir}: has no chat template (no {TEMPLATE_FILE}, and no 'chat_template' in {TEMPLATE_JSON} or "
        f"{TOKENIZER_CONFIG}); chat data need one: pass --chat-template FILE"
    )


def _template_field(config: dict[str, Any], path: Path) -> str | None:
    """The ``chat_template`` of a JSON configuration: a string, or the ``default`` of a list of named ones."""
    value = config.get("chat_template")
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {entry.get("name"): entry.get("template") for entry in value if isinstance(entry, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise DataError(f"{path}: 'chat_template' lists templates {sorted(map(str, named))} but none named 'default'")
    raise DataError(
        f"{path}: 'chat_template' must be a string or a list of named templates, got {type(value).__name__}"
    )


def _read_template_file(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise DataError(f"{path}: no such chat template file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: cannot be read as a UTF-8 chat template ({exc})") from None
    if not text.strip():
        raise DataError(f"{path}: the chat template is empty")
    return text


def _special_tokens(model_dir: Path) -> dict[str, str]:
    """The special tokens of ``tokenizer_config.json`` as strings (a token may be stored as ``{"content": ...}``)."""
    path = model_dir / TOKENIZER_CONFIG
    config = read_json_object(path, DataError) if path.is_file() else {}
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            tokens[name] = value
    return tokens


def _with_reasoning_aliases(message: Mapping[str, Any]) -> Mapping[str, Any]:
    """A message with its reasoning under every name templates read (as transformers does), else unchanged."""
    reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


_COMPILED: dict[str, Any] = {}


def _compile(source: str, origin: str) -> Any:
    """The template compiled in a sandbox configured as transformers configures it (kept per source text)."""
    if source in _COMPILED:
        return _COMPILED[source]
    jinja2, sandbox = _jinja()
    environment = sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(jinja2), "jinja2.ext.loopcontrols"]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["namespace"] = _namespace_class(jinja2)
    try:
        compiled = environment.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise DataError(f"{origin}: the chat template is not valid Jinja (line {exc.lineno}: {exc.message})") from None
    _COMPILED[source] = compiled
    return compiled


def _jinja() -> tuple[Any, Any]:
    try:
        import jinja2
        import jinja2.sandbox
    except ImportError:
        raise DataError(f"chat data need jinja2 to render the chat template: {JINJA_HINT}") from None
    if tuple(int(part) for part in jinja2.__version__.split(".")[:3] if part.isdigit()) < (3, 1, 6):
        raise DataError(f"jinja2 {jinja2.__version__} has known sandbox escapes; chat templates need {JINJA_HINT}")
    return jinja2, jinja2.sandbox


def _generation_extension(jinja2: Any) -> type:
    """``{% generation %}...{% endgeneration %}`` (templates mark the assistant's tokens with it): its body as is."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return Generation


def _namespace_class(jinja2: Any) -> type:
    """Jinja's ``namespace`` refusing names that start with ``_`` (a template is untrusted code: no way to reach
    Python's internals through attributes it stores), as transformers sets it up."""
    from jinja2.utils import Namespace

    def check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not store {name!r} on a namespace")

    class TemplateNamespace(Namespace):
        def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's own signature trick: namespace(self=...) works
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                check(name)
            Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            check(name)
            Namespace.__setitem__(self, name, value)

    return TemplateNamespace


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes HTML characters; templates expect plain JSON (as transformers renders it).
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)

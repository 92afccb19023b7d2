"""The speed / fidelity frontier: decode tokens/s against mean KL for the torch runner's weight
schemes and for llama.cpp on the same model re-quantized to Q4_0, Q4_1 and Q4_K_M (and the torch
runner on the Q4_0 file too).

    python benchmarks/torch_frontier.py [--model qwen2.5-coder-0.5b] [--tokens 2048] [--threads 2]

The reference is llama.cpp on the file as shipped with a float32 KV cache (as
torch_fidelity.py): its next-token distributions over the first --tokens tokens of README.md.
Each candidate runs as a user would run it (its default float16 KV cache; llama.cpp with flash
attention) and is reported with its top-1 agreement, mean KL(reference || candidate) and
perplexity over the same text, and its single-stream decode speed (64-token prompt, 64 tokens,
greedy, no drafting; median of --speed-rounds), all in one run. The re-quantized files are
made with llama.cpp's own llama_model_quantize from the shipped file (allow_requantize: they
are quantized twice, which costs them more than quantizing from 16-bit weights would).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import tempfile
from pathlib import Path

import numpy as np
from _common import machine, median, model_path

from localllm.commands.bench import run_concurrency
from localllm.config import CacheConfig, EngineConfig, SchedulerConfig
from localllm.engine.engine import LLMEngine
from localllm.evaluation import all_logits, log_softmax

FTYPES = {"Q4_0": "LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_1": "LLAMA_FTYPE_MOSTLY_Q4_1", "Q4_K_M": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}


def requantize(src: Path, dest: Path, kind: str, threads: int) -> Path:
    import llama_cpp as L

    params = L.llama_model_quantize_default_params()
    params.ftype = getattr(L, FTYPES[kind])
    params.allow_requantize = True
    params.nthread = threads
    if L.llama_model_quantize(str(src).encode(), str(dest).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize to {kind} failed")
    return dest


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--speed-rounds", type=int, default=3)
    args = parser.parse_args()
    path = model_path(args.model)
    base = EngineConfig(model_path=path, cache=CacheConfig(n_ctx=args.tokens + 256),
                        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
                        n_threads=args.threads, speculative=False, prefix_cache_dir=None)
    from localllm.runners.llamacpp import LlamaCppRunner
    from localllm.runners.torch.runner import TorchRunner

    ref = LlamaCppRunner(dataclasses.replace(base, cache=dataclasses.replace(base.cache, kv_dtype="f32")))
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    text = ref.vocab.tokenize(readme.encode(), True, False)[:args.tokens + 1]
    ref_rows = [(start, log_softmax(rows).astype(np.float32)) for start, rows in all_logits(ref, text)]
    ref.close()

    tmp = Path(tempfile.mkdtemp(prefix="localllm-frontier-"))
    candidates = [("llama.cpp, file as shipped", "llamacpp", path, None)]
    files = {kind: requantize(path, tmp / f"{kind}.gguf", kind, args.threads) for kind in FTYPES}
    for kind, file in files.items():
        candidates.append((f"llama.cpp, re-quantized {kind}", "llamacpp", file, None))
    candidates += [("torch int4 + int8 rows (default)", "torch", path, "int4-int8-bf16"),
                   ("torch int4 for 4-5 bit, int8 for 6-8 bit", "torch", path, "int4-bf16"),
                   ("torch gguf-blocks (the file's blocks, native kernel)", "torch", path, "gguf-blocks"),
                   ("torch gguf-blocks, re-quantized Q4_0", "torch", files["Q4_0"], "gguf-blocks")]
    results = []
    for label, runner, file, scheme in candidates:
        config = dataclasses.replace(base, model_path=file, runner=runner)
        r = TorchRunner(config, scheme=scheme) if runner == "torch" else LlamaCppRunner(config)
        agree = n = 0
        kl = nll = 0.0
        for (start, la), (_, rows) in zip(ref_rows, all_logits(r, text)):
            lb = log_softmax(rows)
            targets = np.array(text[start + 1:start + 1 + len(rows)])
            agree += int((la.argmax(-1) == lb.argmax(-1)).sum())
            kl += float((np.exp(la) * (la - lb)).sum())
            nll -= float(lb[np.arange(len(rows)), targets].sum())
            n += len(rows)
        r.close()
        r = TorchRunner(config, scheme=scheme) if runner == "torch" else LlamaCppRunner(config)
        engine = LLMEngine(config, runner=r)
        speeds = [run_concurrency(engine, 1, 64, 64)["decode_tokens_per_s"] for _ in range(args.speed_rounds)]
        engine.close()
        size = file.stat().st_size / 2**20
        results.append((label, median(speeds), agree / n, kl / n, float(np.exp(nll / n)), size))
        print(f"{label}: decode {median(speeds):.1f} tok/s, top-1 {agree / n:.4f}, KL {kl / n:.5f}, "
              f"PPL {np.exp(nll / n):.3f}, file {size:.0f} MiB", flush=True)
    ref_nll = -sum(float(la[np.arange(len(la)), np.array(text[s + 1:s + 1 + len(la)])].sum()) for s, la in ref_rows)
    print(f"\n{machine()}; {args.threads} threads; {path.name}; {len(text) - 1} positions of README.md; "
          f"reference perplexity {np.exp(ref_nll / (len(text) - 1)):.3f}")
    print("| candidate | decode tok/s | top-1 | mean KL | perplexity | file MiB |")
    print("|---|---|---|---|---|---|")
    for label, speed, top1, kl, ppl, size in results:
        print(f"| {label} | {speed:.1f} | {top1 * 100:.2f} % | {kl:.5f} | {ppl:.3f} | {size:.0f} |")


if __name__ == "__main__":
    main()

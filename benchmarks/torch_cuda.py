"""The torch runner on CUDA: decode steps replayed as CUDA graphs against the same runner
launching every kernel from Python, same run.

    python benchmarks/torch_cuda.py --file F.gguf [--rounds 3] [--json OUT.json]

Per round, alternating the engines (graphs, then eager): decode tokens/s of one stream and
the aggregate of 16 (64-token prompts, 128 tokens each, greedy, no drafting, EOS ignored:
what `localllm bench --no-spec` measures), and the time to first token of one 2,000-token
prompt at the default step budget (the runner's: 2,048 tokens on CUDA) and at 256 (the CPU's).
Also, for the graphs engine: the time of one replayed decode step of 1 and 16 sequences
alone (CUDA events, median of 200), and the share of a decode step the engine spends
outside the runner (scheduling, sampling, detokenizing). Medians of the rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from _common import machine, median, model_path

from localllm.commands.bench import run_concurrency
from localllm.config import CacheConfig, EngineConfig, SchedulerConfig
from localllm.engine.engine import LLMEngine


def replay_ms(runner, n: int, reps: int = 200) -> float:
    """Median ms of one DecodeGraphs step of n sequences (each one block, position 8)."""
    import torch

    steps = [(100 + i, 8, [i]) for i in range(n)]
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.graphs.run(steps)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_profile(runner) -> str:
    """One decode step of one sequence through the static path, run eagerly under torch's
    profiler: how many kernels a step is, their summed GPU time, and the costliest."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    graphs = runner.graphs
    graphs.capture = False
    try:
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            graphs.run([(100, 8, [0])])
            torch.cuda.synchronize()
    finally:
        graphs.capture = True
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy = sum(getattr(e, "device_time", 0) or getattr(e, "cuda_time", 0) for e in kernels) / 1000
    table = ""
    for key in ("self_device_time_total", "self_cuda_time_total"):
        try:
            table = prof.key_averages().table(sort_by=key, row_limit=15)
            break
        except Exception:  # the key's name differs between torch versions
            continue
    return f"kernels per decode step (1 sequence): {len(kernels)}, their GPU time {busy:.3f} ms\n{table}"


def outside_runner_share(engine, concurrency: int) -> float:
    """Of a decode run's step time, the share spent outside runner.execute."""
    execute, inside = engine.runner.execute, [0.0]

    def timed(out):
        t = time.perf_counter()
        try:
            return execute(out)
        finally:
            inside[0] += time.perf_counter() - t

    engine.runner.execute = timed
    try:
        t = time.perf_counter()
        run_concurrency(engine, concurrency, 64, 128)
        total = time.perf_counter() - t
    finally:
        engine.runner.execute = execute
    return 1 - inside[0] / total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="qwen2.5-coder-0.5b")
    parser.add_argument("--file", type=Path, help="a GGUF file instead of --model")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128, help="tokens each stream decodes")
    parser.add_argument("--prompt", type=int, default=2000, help="the long prompt's tokens")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    import torch

    from localllm.runners.torch.runner import TorchRunner

    path = args.file or model_path(args.model)
    config = EngineConfig(model_path=path, runner="torch", speculative=False, cache=CacheConfig(n_ctx=8192),
                          scheduler=SchedulerConfig(max_num_seqs=16))
    narrow = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)  # the CPU's default budget
    engines = {}
    for name, graphs in (("graphs", None), ("eager", False)):
        t = time.perf_counter()
        engines[name] = LLMEngine(config, runner=TorchRunner(config, graphs=graphs))
        print(f"{name}: loaded in {time.perf_counter() - t:.1f} s on {engines[name].runner.device}; "
              f"graphs {'on' if engines[name].runner.graphs is not None else 'off'}", flush=True)
    for engine in engines.values():
        for n in (1, 16):  # capture / compile outside the timed runs
            run_concurrency(engine, n, 64, 8)
    rows = {name: {"1": [], "16": [], "prefill": [], "prefill_256": []} for name in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            nan = float("nan")  # (no step had every stream decoding: too few tokens)
            one = run_concurrency(engine, 1, 64, args.tokens)["decode_tokens_per_s"] or nan
            many = run_concurrency(engine, 16, 64, args.tokens)["decode_tokens_per_s"] or nan
            ttft = run_concurrency(engine, 1, args.prompt, 1)["ttft_p50_s"]
            default = engine.scheduler.config
            engine.scheduler.config = narrow  # the prompt in 256-token steps
            try:
                ttft_narrow = run_concurrency(engine, 1, args.prompt, 1)["ttft_p50_s"]
            finally:
                engine.scheduler.config = default
            for key, value in (("1", one), ("16", many), ("prefill", ttft * 1000), ("prefill_256", ttft_narrow * 1000)):
                rows[name][key].append(value)
            print(f"round {r + 1} {name:7s} decode 1 stream {one:7.1f} tok/s, 16 streams {many:8.1f} tok/s; "
                  f"{args.prompt}-token prompt TTFT {ttft * 1000:6.1f} ms (default budget "
                  f"{default.max_num_batched_tokens}), {ttft_narrow * 1000:6.1f} ms (budget 256)", flush=True)
    g = engines["graphs"]
    extra = {}
    if g.runner.graphs is not None and g.runner.graphs.capture:
        extra = {"replay_ms_1": replay_ms(g.runner, 1), "replay_ms_16": replay_ms(g.runner, 16),
                 "outside_share_1": outside_runner_share(g, 1), "outside_share_16": outside_runner_share(g, 16)}
    med = {name: {k: median(v) for k, v in r.items()} for name, r in rows.items()}
    print(f"\n{machine()}; {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA'}; "
          f"torch {torch.__version__}; {path.name}; medians of {args.rounds} rounds")
    print(f"| runner | decode, 1 stream | decode, 16 streams (aggregate) | 16 / 1 | {args.prompt}-token prefill, "
          f"default budget ({engines['graphs'].config.scheduler.max_num_batched_tokens}) | budget 256 |")
    print("|---|---|---|---|---|---|")
    for name, m in med.items():
        print(f"| {name} | {m['1']:.1f} tok/s | {m['16']:.1f} tok/s | {m['16'] / m['1']:.2f}x | "
              f"{m['prefill']:.1f} ms | {m['prefill_256']:.1f} ms |")
    print(f"graphs / eager, 1 stream: {med['graphs']['1'] / med['eager']['1']:.2f}x; "
          f"16 streams: {med['graphs']['16'] / med['eager']['16']:.2f}x")
    for k, v in extra.items():
        print(f"{k}: {v:.3f}")
    if extra:
        try:
            print(kernel_profile(g.runner))
        except Exception as e:  # the profiler is a diagnosis, not a figure
            print(f"profile failed: {type(e).__name__}: {e}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "medians": med, **extra}, indent=1))


if __name__ == "__main__":
    main()

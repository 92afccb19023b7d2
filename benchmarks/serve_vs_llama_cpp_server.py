"""`localllm serve` against llama-cpp-python's own server (`python -m llama_cpp.server`, with
`--interrupt_requests False`), same file, threads and context, driven by the same
`localllm bench --url` scenario, alternating (A B A B ...).

    python benchmarks/serve_vs_llama_cpp_server.py [--rounds 3] [--concurrency 4] [--runner torch]

Needs llama-cpp-python's `server` extra: pip install 'llama-cpp-python[server]'.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import httpx
from _common import machine, median, model_path

from localllm.commands.bench import bench_url


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(240):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"server on port {port} did not start: {' '.join(cmd)}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--runner", default="auto", help="localllm serve's --runner")
    args = parser.parse_args()
    path = str(model_path())
    ours_port, theirs_port = free_port(), free_port()
    ours = start([sys.executable, "-m", "localllm.cli", "serve", "--model", path, "--port", str(ours_port),
                  "--threads", str(args.threads), "--ctx", "4096", "--runner", args.runner], ours_port)
    theirs = start([sys.executable, "-m", "llama_cpp.server", "--model", path, "--port", str(theirs_port),
                    "--n_threads", str(args.threads), "--n_threads_batch", str(args.threads), "--n_ctx", "4096",
                    "--interrupt_requests", "False"], theirs_port)
    import contextlib
    import io
    import json

    def run(port: int) -> dict:
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            bench_url(f"http://127.0.0.1:{port}/v1", None, [args.concurrency], args.prompt_tokens,
                      args.max_tokens, as_json=True)
        return json.loads(buf.getvalue())["results"][0]

    try:
        a, b = [], []
        for r in range(args.rounds):
            x, y = run(ours_port), run(theirs_port)
            a.append(x["output_tokens_per_s"])
            b.append(y["output_tokens_per_s"])
            print(f"round {r + 1}: localllm serve {x['output_tokens_per_s']:6.1f} tok/s "
                  f"(TTFT p50 {x['ttft_p50_s'] * 1000:5.0f} ms, TPOT p50 {x['tpot_p50_s'] * 1000:5.1f} ms) | "
                  f"llama_cpp.server {y['output_tokens_per_s']:6.1f} tok/s "
                  f"(TTFT p50 {y['ttft_p50_s'] * 1000:5.0f} ms, TPOT p50 {y['tpot_p50_s'] * 1000:5.1f} ms)", flush=True)
        print(f"\n{machine()}, {args.threads} threads, {args.concurrency} streaming clients, runner {args.runner}, "
              f"{args.prompt_tokens}-word prompts, {args.max_tokens} tokens")
        print(f"median aggregate output: localllm serve {median(a):.1f} tok/s, llama_cpp.server {median(b):.1f} "
              f"tok/s, ratio {median(a) / median(b):.2f}")
    finally:
        for p in (ours, theirs):
            p.terminate()
            p.wait(timeout=30)


if __name__ == "__main__":
    main()

"""A real thinking model through `localllm serve`: is its reasoning kept out of the answer?

    python benchmarks/reasoning_split.py --model Qwen3-0.6B-Q8_0.gguf [--prompts 20] [--max-tokens 512]

No thinking model is on the package index (the tests' Qwen3 check runs Qwen3's real template
over a scripted engine: tests/unit/test_reasoning_doors.py); this script is for a machine that
has one (`localllm pull hf.co/unsloth/Qwen3-0.6B-GGUF:Q8_0`, or a DeepSeek-R1 distill). For
each prompt it streams a chat completion twice through the official openai client, thinking on
and with `reasoning_effort: "none"`, and counts: answers whose content holds `<think>` or
`</think>` (must be 0), answers with reasoning when thinking is on, answers with reasoning when
it is off (0 where the template can turn it off), and the median seconds to the first reasoning
and to the first content token.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
from _common import machine, median

PROMPTS = ["What is 17 * 23?", "Is 221 a prime number?", "Name three prime numbers above 100.",
           "Which is larger, 2**10 or 10**3?", "Write a haiku about rain.", "What day follows Tuesday?",
           "How many legs do three spiders have?", "Reverse the word 'localllm'.",
           "What is the capital of Australia?", "Sort these: 5, 3, 9, 1.", "What is 2/3 + 1/6?",
           "Spell 'necessary' backwards.", "How many minutes are in a day?", "Is 0 even?",
           "What is the square root of 144?", "Give a synonym of 'quick'.", "What is 15% of 80?",
           "Convert 100 Celsius to Fahrenheit.", "Count the vowels in 'reasoning'.", "What comes after Z?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(client: openai.OpenAI, model: str, prompt: str, max_tokens: int, thinking: bool) -> dict:
    start, first_reasoning, first_content = time.perf_counter(), None, None
    reasoning, content = "", ""
    extra = {} if thinking else {"reasoning_effort": "none"}
    for chunk in client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=max_tokens, temperature=0, stream=True, extra_body=extra):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        r, c = getattr(delta, "reasoning_content", None) or "", delta.content or ""
        if r and first_reasoning is None:
            first_reasoning = time.perf_counter() - start
        if c and first_content is None:
            first_content = time.perf_counter() - start
        reasoning, content = reasoning + r, content + c
    return {"reasoning": reasoning, "content": content, "first_reasoning": first_reasoning,
            "first_content": first_content}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True, help="a thinking model's GGUF (Qwen3, a DeepSeek-R1 distill)")
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "localllm.cli", "serve", "--model", args.model, "--port",
                               str(port), "--threads", str(args.threads), "--ctx", "4096"],
                              stderr=subprocess.DEVNULL, env=os.environ)
    try:
        for _ in range(240):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=600)
        model = client.models.list().data[0].id
        on = [run(client, model, p, args.max_tokens, True) for p in PROMPTS[:args.prompts]]
        off = [run(client, model, p, args.max_tokens, False) for p in PROMPTS[:args.prompts]]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)
    leaked = sum("<think>" in r["content"] or "</think>" in r["content"] for r in on + off)
    print(f"{machine()}; model {model}; {len(on)} prompts, max_tokens {args.max_tokens}, greedy")
    print(f"content holding a think marker: {leaked} of {len(on) + len(off)}")
    print(f"thinking on: {sum(bool(r['reasoning']) for r in on)} of {len(on)} with reasoning; "
          f"off: {sum(bool(r['reasoning']) for r in off)} of {len(off)}")
    firsts = [r["first_reasoning"] for r in on if r["first_reasoning"] is not None]
    contents = [r["first_content"] for r in on if r["first_content"] is not None]
    if firsts and contents:
        print(f"median s to the first reasoning token {median(firsts):.2f}, to the first content token "
              f"{median(contents):.2f}")
    return 1 if leaked else 0


if __name__ == "__main__":
    sys.exit(main())

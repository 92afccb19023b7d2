"""tool_choice "required" through `localllm serve` and the official openai client: does every
call parse and validate against its tool's parameters schema?

    python benchmarks/tool_calls.py [--requests 200] [--runners llamacpp,torch] [--clients 8]

For each runner, one `localllm serve` process; ``--requests`` chat requests, each with its own
seed (temperature 0.8), tool_choice "required" and three tools whose parameters have nested
objects, enums, integer bounds, arrays and optional fields; ``--clients`` at once. A request
fails when it errs, finishes without exactly one tool call, its arguments do not parse as JSON
or do not validate with ``jsonschema``, or its tool is not one of the request's.
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, model_path  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "book_flight", "description": "Book a flight", "parameters": {
        "type": "object", "properties": {
            "from": {"type": "string", "pattern": "^[A-Z]{3}$"}, "to": {"type": "string", "pattern": "^[A-Z]{3}$"},
            "date": {"type": "string", "format": "date"},
            "passengers": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
                "type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                                 "age": {"type": "integer", "minimum": 0, "maximum": 120}},
                "required": ["name", "age"], "additionalProperties": False}},
            "cabin": {"enum": ["economy", "premium", "business", "first"]}},
        "required": ["from", "to", "date", "passengers"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 60},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "set_reminder", "description": "Set a reminder", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 80},
                                         "in_minutes": {"type": "integer", "minimum": 1, "maximum": 10080},
                                         "repeat": {"type": "boolean"}},
        "required": ["text", "in_minutes"], "additionalProperties": False}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASKS = ["Fly me and my daughter (7) from Paris to Tokyo on 2027-03-14.", "Is it raining in Lisbon?",
        "Remind me to call mum in two hours.", "What should I wear in Oslo today?",
        "Book business class LHR to JFK next Friday for Ann Lee, 34.", "Ping me every day about the standup."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one(client: openai.OpenAI, model: str, i: int) -> str | None:
    """None when the call is right, else what is wrong."""
    try:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": ASKS[i % len(ASKS)]}], tools=TOOLS,
            tool_choice="required", temperature=0.8, seed=i, max_tokens=300)
    except openai.APIError as e:
        return f"error: {e}"
    calls = r.choices[0].message.tool_calls or []
    if len(calls) != 1 or r.choices[0].finish_reason != "tool_calls":
        return f"{len(calls)} calls, finish {r.choices[0].finish_reason}: {r.choices[0].message.content!r}"
    call = calls[0].function
    if call.name not in SCHEMAS:
        return f"unknown tool {call.name}"
    try:
        cls = jsonschema.validators.validator_for(SCHEMAS[call.name])
        cls(SCHEMAS[call.name], format_checker=cls.FORMAT_CHECKER).validate(json.loads(call.arguments))
    except (json.JSONDecodeError, jsonschema.ValidationError) as e:
        return f"{call.name} {call.arguments!r}: {e}"
    return None


def run(runner: str, requests: int, clients: int) -> None:
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "serve.log"
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "localllm.cli", "serve", "--model", str(model_path()),
                                   "--port", str(port), "--runner", runner, "--ctx", "8192"],
                                  stdout=out, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.25)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        start = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            failures = [f for f in pool.map(lambda i: one(client, model, i), range(requests)) if f is not None]
        seconds = time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(60)
    print(f"| {runner} | {requests} | {requests - len(failures)} | {len(failures)} | {seconds:.0f} s |")
    for failure in failures[:10]:
        print(f"  - {failure}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--runners", default="llamacpp,torch")
    ap.add_argument("--clients", type=int, default=8)
    args = ap.parse_args()
    print(f"# {machine()}; {model_path().name}; {args.clients} clients at once\n")
    print("| runner | requests | valid calls | failures | wall |\n|---|---|---|---|---|")
    for runner in args.runners.split(","):
        run(runner, args.requests, args.clients)


if __name__ == "__main__":
    main()

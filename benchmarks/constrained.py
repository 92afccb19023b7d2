"""Structured output: what a grammar's mask costs per token, and what a json_schema request
decodes at against the same request unconstrained.

    python benchmarks/constrained.py [--rounds 3] [--runners llamacpp,torch] [--baseline REV]

Mask time: the tokens of real JSON answers (Qwen2.5-Coder-0.5B's vocabulary of 152k tokens),
one at a time, each position's mask timed and then the token accepted, split by whether the
position is inside a JSON string. "llguidance" is engine/constraint.py (the mask computed,
then applied to a logits row); "GBNF" is what the engine used before it: llama.cpp's grammar
sampler behind a first-byte index, read from git at ``--baseline`` (the commit before the
change). Decode: one request, greedy, drafting as the engine's default, constrained by a
JSON schema against the same prompt unconstrained with ignore_eos and the same number of
tokens, alternating A B A B; the figure is the request's decode tokens/s (after its first token).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, median, model_path  # noqa: E402

from localllm.config import CacheConfig, EngineConfig  # noqa: E402
from localllm.engine import constraint as C  # noqa: E402
from localllm.engine.engine import LLMEngine  # noqa: E402
from localllm.engine.request import SamplingParams  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

ORDER = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
        "customer": {"type": "object", "properties": {
            "name": {"type": "string"}, "email": {"type": "string", "format": "email"},
            "address": {"type": "string"}}, "required": ["name", "email", "address"]},
        "items": {"type": "array", "minItems": 3, "maxItems": 3, "items": {
            "type": "object", "properties": {"sku": {"type": "string"}, "description": {"type": "string"},
                                             "quantity": {"type": "integer", "minimum": 1},
                                             "unit_price": {"type": "number"}},
            "required": ["sku", "description", "quantity", "unit_price"], "additionalProperties": False}},
        "notes": {"type": "string"},
    },
    "required": ["order_id", "customer", "items", "notes"],
    "additionalProperties": False,
}
ANSWERS = [  # what the masks are timed over: long strings, numbers, nesting
    {"order_id": "ABC-123456", "customer": {"name": "Zoë Ångström-Müller", "email": "zoe@example.org",
                                            "address": "12 Rue de la Paix, 75002 Paris, France"},
     "items": [{"sku": "KB-001", "description": "Mechanical keyboard with brown switches and a walnut wrist rest",
                "quantity": 1, "unit_price": 149.99},
               {"sku": "MS-204", "description": "Wireless mouse, 2.4 GHz and Bluetooth, graphite",
                "quantity": 2, "unit_price": 39.5},
               {"sku": "CB-USB-C", "description": "USB-C to USB-C cable, 2 m, braided", "quantity": 3,
                "unit_price": 12.0}],
     "notes": "Please deliver after 6 pm; the concierge (東京 office) will sign. \"Fragile\" on every box."},
]
PROMPT = ("Write one example order for an online shop as JSON: an order_id like ABC-123456, the customer "
          "(name, email, address), exactly three items (sku, description, quantity, unit_price) and notes.")


def old_constraints(rev: str):
    """The engine's grammar code at ``rev``: runners/llamacpp.py, loaded under another name."""
    source = subprocess.run(["git", "show", f"{rev}:localllm/runners/llamacpp.py"], cwd=REPO, check=True,
                            capture_output=True, text=True).stdout
    if "class _FirstByteIndex" not in source:
        raise SystemExit(f"{rev} has no first-byte index in runners/llamacpp.py; give the commit before the change")
    path = Path(tempfile.mkdtemp()) / "llamacpp_baseline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("llamacpp_baseline", path)
    module = sys.modules["llamacpp_baseline"] = module_from_spec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module_from_spec)
    return module


def restore_log() -> None:
    """llama.cpp's log callback back to the engine's (the baseline module set its own)."""
    import ctypes

    import llama_cpp

    from localllm.runners import llamacpp

    llama_cpp.llama_log_set(llamacpp._quiet_log, ctypes.c_void_p(0))


def in_string_flags(text: str, offsets: list[int]) -> list[bool]:
    """For each byte offset: whether the JSON text before it ends inside a string."""
    flags, inside, escaped, i = [], False, False, 0
    data = text.encode()
    for end in offsets:
        while i < end:
            ch = data[i]
            if escaped:
                escaped = False
            elif ch == 0x5C and inside:
                escaped = True
            elif ch == 0x22:
                inside = not inside
            i += 1
        flags.append(inside)
    return flags


def time_masks(engine: LLMEngine, old, rounds: int) -> dict[str, dict[bool, list[float]]]:
    """{"GBNF" | "llguidance": {in_string: [seconds per mask]}} over ANSWERS, ``rounds`` times."""
    tok, n = engine.tokenizer, engine.runner.vocab.n_vocab
    vocab_file = old.VocabFile(Path(engine.config.model_path))
    rng = np.random.default_rng(0)
    times: dict[str, dict[bool, list[float]]] = {"GBNF": {True: [], False: []}, "llguidance": {True: [], False: []}}
    engine.grammars.tokenizer  # built once, outside the timings (~0.6 s on first use)
    for _ in range(rounds):
        for answer in ANSWERS:
            text = json.dumps(answer, ensure_ascii=False)
            ids = tok.encode(text, add_special=False)
            offsets = np.cumsum([0] + [len(tok.piece(t)) for t in ids])[:-1].tolist()
            flags = in_string_flags(text, offsets)
            logits = rng.standard_normal(n).astype(np.float32)
            logits.flags.writeable = False
            new = engine.grammars.constraint(C.json_grammar(ORDER))
            mask = new.new_masks(1)[0]
            gbnf = vocab_file.make_constraint(old.json_schema_to_grammar(ORDER))
            for token, inside in zip(ids, flags):
                start = time.perf_counter()
                new.fill(mask)
                masked = new.masked(logits, mask)
                times["llguidance"][inside].append(time.perf_counter() - start)
                assert np.isfinite(masked[token])
                new.accept(token)
                start = time.perf_counter()
                masked = gbnf.apply(logits)
                times["GBNF"][inside].append(time.perf_counter() - start)
                assert np.isfinite(masked[token])
                gbnf.accept(token)
            gbnf.free()
            new.free()
    vocab_file.close()
    return times


def decode_rates(engine: LLMEngine, rounds: int, speculative: bool | None) -> dict[str, list[float]]:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    grammar = C.json_grammar(ORDER)
    rates: dict[str, list[float]] = {"json_schema": [], "unconstrained": []}
    for r in range(rounds + 1):  # the first round warms up, unmeasured
        out = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=400, grammar=grammar,
                                                       speculative=speculative))[0]
        json.loads(out.text)
        n = len(out.token_ids)
        free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True,
                                                        speculative=speculative))[0]
        if r:
            rates["json_schema"].append(out.metrics.decode_tokens_per_s)
            rates["unconstrained"].append(free.metrics.decode_tokens_per_s)
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runners", default="llamacpp,torch")
    ap.add_argument("--baseline", default="15154ec", help="a commit with the GBNF code (the one before the change)")
    args = ap.parse_args()
    path = model_path()
    print(f"# {machine()}; {path.name}\n")
    for runner in args.runners.split(","):
        engine = LLMEngine(EngineConfig(model_path=str(path), runner=runner, cache=CacheConfig(n_ctx=4096)))
        if runner == args.runners.split(",")[0]:
            times = time_masks(engine, old_constraints(args.baseline), args.rounds)
            restore_log()
            print("| mask, per token | position | tokens | p50 µs | p99 µs | max µs |")
            print("|---|---|---|---|---|---|")
            for name, by_place in times.items():
                for inside in (False, True):
                    ts = np.array(by_place[inside]) * 1e6
                    print(f"| {name} | {'in a string' if inside else 'outside strings'} | {ts.size // args.rounds} | "
                          f"{np.percentile(ts, 50):.0f} | {np.percentile(ts, 99):.0f} | {ts.max():.0f} |")
            print()
        print(f"| {runner}: decode tok/s | drafting | json_schema | unconstrained | ratio |")
        print("|---|---|---|---|---|")
        for speculative, label in ((None, "default"), (False, "off")):
            rates = decode_rates(engine, args.rounds, speculative)
            a, b = median(rates["json_schema"]), median(rates["unconstrained"])
            print(f"| {runner} | {label} | {a:.1f} | {b:.1f} | {a / b:.2f} |")
        print()
        engine.close()


if __name__ == "__main__":
    main()

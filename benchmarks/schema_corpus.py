"""Structured output on real-world JSON schemas that no one here wrote: does every answer
constrained by a schema parse and validate?

    python benchmarks/schema_corpus.py [--num-aws 100] [--runner llamacpp] [--max-tokens 512]

The corpus comes from two packages on the index, read from their wheels (pip download, no
install): check-jsonschema 0.39.0 vendors SchemaStore's schemas of CI and tool configuration
files (GitHub workflows, GitLab CI, compose, Renovate...), and cfn-lint 1.58.0 carries AWS
CloudFormation's resource provider schemas (every ``--num-aws``-th of its 1,898, by name).
Each schema is compiled (engine/constraint.py); a schema it refuses is counted with the reason
(the keywords it cannot enforce, named). Each compiled one gets a chat request for an example
document, sampled (temperature 0.7, a seed per schema), eight at a time through the engine;
the answer must parse as JSON and validate with ``jsonschema`` (formats checked). An answer
cut at --max-tokens is counted apart: it never finished.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import jsonschema
import regex

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, model_path  # noqa: E402

from localllm.config import CacheConfig, EngineConfig  # noqa: E402
from localllm.engine import constraint as C  # noqa: E402
from localllm.engine.engine import LLMEngine  # noqa: E402
from localllm.engine.request import SamplingParams  # noqa: E402
from localllm.errors import UsageError  # noqa: E402

WHEELS = {"check-jsonschema": "0.39.0", "cfn-lint": "1.58.0"}
CACHE = Path.home() / ".cache" / "localllm-bench" / "wheels"


def wheel(name: str) -> zipfile.ZipFile:
    version = WHEELS[name]
    pattern = f"{name.replace('-', '_')}-{version}-*.whl"
    found = sorted(CACHE.glob(pattern))
    if not found:
        CACHE.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(CACHE),
                        f"{name}=={version}"], check=True)
        found = sorted(CACHE.glob(pattern))
    return zipfile.ZipFile(found[0])


def corpus(num_aws: int) -> list[tuple[str, dict]]:
    schemas = []
    with wheel("check-jsonschema") as z:
        for name in sorted(z.namelist()):
            if re.fullmatch(r"check_jsonschema/builtin_schemas/vendor/[^/]+\.json", name):
                schemas.append((f"schemastore/{Path(name).stem}", json.loads(z.read(name))))
    with wheel("cfn-lint") as z:
        names = sorted(n for n in z.namelist() if re.fullmatch(r"cfnlint/data/schemas/resources/[^/]+\.json", n))
        for name in names[:: max(1, len(names) // num_aws)][:num_aws]:
            schema = json.loads(z.read(name))
            schemas.append((f"aws/{schema.get('typeName', Path(name).stem)}", schema))
    return schemas


def validator(schema: dict) -> jsonschema.protocols.Validator:
    """jsonschema's validator of the schema's draft, formats checked, with patterns read by
    ``regex`` (as JSON Schema's ECMA-262 patterns: \\p{L} and the like, which re lacks)."""
    cls = jsonschema.validators.validator_for(schema)

    def pattern(validator, patrn, instance, schema):
        if validator.is_type(instance, "string") and not regex.search(patrn, instance):
            yield jsonschema.ValidationError(f"{instance!r} does not match {patrn!r}")

    def pattern_properties(validator, patterns, instance, schema):
        if validator.is_type(instance, "object"):
            for patrn, subschema in patterns.items():
                for key, value in instance.items():
                    if regex.search(patrn, key):
                        yield from validator.descend(value, subschema, path=key, schema_path=patrn)

    cls = jsonschema.validators.extend(cls, {"pattern": pattern, "patternProperties": pattern_properties})
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def prompt_text(name: str, schema: dict) -> str:
    about = str(schema.get("title") or schema.get("description") or "")[:400]
    return f"Write an example JSON document for {name}. {about}".strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-aws", type=int, default=100)
    ap.add_argument("--runner", default="llamacpp")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    path = model_path()
    engine = LLMEngine(EngineConfig(model_path=str(path), runner=args.runner, cache=CacheConfig(n_ctx=16384)))
    schemas = corpus(args.num_aws)
    print(f"# {machine()}; {path.name}, {args.runner} runner; {len(schemas)} schemas\n")
    refused: dict[str, str] = {}
    compiled: list[tuple[str, dict, str]] = []
    compile_s = []
    for name, schema in schemas:
        start = time.perf_counter()
        try:
            grammar = C.json_grammar(schema)
            engine.check_grammar(grammar)
        except UsageError as e:
            refused[name] = str(e)
            continue
        finally:
            compile_s.append(time.perf_counter() - start)
        compiled.append((name, schema, grammar))

    results: dict[str, str] = {}
    started = time.perf_counter()
    pending = list(enumerate(compiled))
    running: dict[str, tuple[str, dict]] = {}
    texts: dict[str, str] = {}
    while pending or running:
        while pending and len(running) < args.batch:
            i, (name, schema, grammar) = pending.pop(0)
            prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt_text(name, schema)}])
            params = SamplingParams(temperature=0.7, seed=i, max_tokens=args.max_tokens, grammar=grammar)
            seq = engine.add_request(prompt, params)
            running[seq.request_id] = (name, schema)
        for out in engine.step():
            texts[out.request_id] = texts.get(out.request_id, "") + out.text
            if not out.finished:
                continue
            name, schema = running.pop(out.request_id)
            seq_text = texts.pop(out.request_id)
            if out.finish_reason == "length":
                results[name] = "cut at max_tokens"
                continue
            if out.finish_reason != "stop":
                results[name] = f"ended: {out.finish_reason}"
                continue
            try:
                value = json.loads(seq_text)
                validator(schema).validate(value)
                results[name] = "valid"
            except json.JSONDecodeError as e:
                results[name] = f"does not parse: {e}"
            except jsonschema.ValidationError as e:
                results[name] = f"invalid: {e.message[:200]}"
    seconds = time.perf_counter() - started

    counts = collections.Counter(r if r in ("valid", "cut at max_tokens") else r.split(":")[0] for r in results.values())
    print(f"compiled {len(compiled)} of {len(schemas)} ({len(compiled) / len(schemas):.0%}); "
          f"compile p50 {sorted(compile_s)[len(compile_s) // 2] * 1e3:.0f} ms, max {max(compile_s) * 1e3:.0f} ms")
    print(f"answers: {dict(counts)}; {seconds:.0f} s for {len(compiled)} requests\n")
    finished = [r for r in results.values() if r != "cut at max_tokens"]
    print(f"finished answers that parse and validate: {sum(r == 'valid' for r in finished)} of {len(finished)}\n")
    keywords = collections.Counter(k for reason in refused.values() if "which localllm" in reason
                                   for k in (re.findall(r'"([\w-]+)"', reason.split("which localllm")[0])
                                             or ["look-around in a pattern"]))
    others = collections.Counter(reason.splitlines()[0].split(": ", 1)[-1][:70] for reason in refused.values()
                                 if "which localllm" not in reason)
    print("| refused schema | reason |\n|---|---|")
    for name, reason in refused.items():
        print(f"| {name} | {' '.join(reason.split())[:200]} |")
    print(f"\nrefused for keywords it cannot enforce (schemas naming each): {dict(keywords.most_common())}")
    print(f"refused otherwise: {dict(others.most_common())}\n")
    print("| schema | answer |\n|---|---|")
    for name, result in results.items():
        if result != "valid":
            print(f"| {name} | {result} |")

if __name__ == "__main__":
    main()

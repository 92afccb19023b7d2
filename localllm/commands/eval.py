"""`localllm eval`: what a runner and KV dtype cost on a text, against llama.cpp's defaults.

The text runs through the candidate configuration and through the reference: the llama.cpp
runner with its default float16 KV cache (and its default flash attention) on the same file.
Reported: each one's perplexity on the text, and the candidate's top-1 agreement with the
reference and mean KL(reference || candidate) of the next-token distributions (see
localllm/evaluation.py). The default text is a public-domain passage shipped with localllm
(localllm/data/README.md says what it is).
"""

from __future__ import annotations

import dataclasses
import json
import time
from importlib import resources
from pathlib import Path

from localllm.config import EngineConfig
from localllm.errors import UsageError
from localllm.evaluation import CHUNK, compare

MIN_TOKENS = 16
MAX_TOKENS = 16384  # the whole text is one sequence in one context
BUILTIN_TEXT_NAME = "built-in text (Shakespeare, Coriolanus I.1)"
_RUNNER_NAMES = {"llamacpp": "llama.cpp", "torch": "torch"}


def read_text(path: Path | None) -> tuple[str, str]:
    """(name to show, text) of --text PATH, or of the built-in text when path is None."""
    if path is None:
        text = resources.files("localllm").joinpath("data/eval.txt").read_text(encoding="utf-8")
        return BUILTIN_TEXT_NAME, text
    if not path.exists():
        raise UsageError(f"--text {path} does not exist; give a UTF-8 text file")
    if not path.is_file():
        raise UsageError(f"--text {path} is not a file; give a UTF-8 text file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--text {path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                         f"{e.start}); save it as UTF-8") from None
    if not text.strip():
        raise UsageError(f"--text {path} is empty; give a text of at least {MIN_TOKENS} tokens")
    return path.name, text


def tokenize(model_path: Path, text: str, text_name: str) -> list[int]:
    """The text's tokens (with the model's BOS where it adds one), of a length eval takes."""
    from localllm.runners.llamacpp import VocabFile

    vocab_file = VocabFile(model_path)
    try:
        token_ids = vocab_file.vocab.tokenize(text.encode("utf-8"), True, False)
    finally:
        vocab_file.close()
    if len(token_ids) < MIN_TOKENS:
        raise UsageError(f"{text_name} is {len(token_ids)} tokens; eval needs at least {MIN_TOKENS}: "
                         "give a longer text")
    if len(token_ids) > MAX_TOKENS:
        raise UsageError(f"{text_name} is {len(token_ids):,} tokens; eval takes at most {MAX_TOKENS:,}: "
                         "shorten it")
    return token_ids


def context_for(num_tokens: int, block_size: int = 16) -> int:
    """A context that holds the whole text and at least one chunk."""
    return max(CHUNK, -(-num_tokens // block_size) * block_size)


def evaluate(config: EngineConfig, token_ids: list[int], text_name: str, as_json: bool = False) -> int:
    """Run the text through config's runner and KV dtype and through the reference; print
    the result. config's context must hold the text and its step budget one chunk."""
    from localllm.engine.engine import load_runner

    reference_config = dataclasses.replace(
        config, runner="llamacpp", cache=dataclasses.replace(config.cache, kv_dtype="f16"))
    t0 = time.perf_counter()
    candidate = load_runner(config)  # "torch" on an architecture it lacks falls back to llama.cpp
    reference = None
    try:
        is_same = candidate.name == "llamacpp" and config.cache.kv_dtype == "f16"
        if is_same:
            reference = candidate
        else:
            from localllm.runners.llamacpp import LlamaCppRunner

            reference = LlamaCppRunner(reference_config)
        tally = compare(reference, candidate, token_ids)
    finally:
        if reference is not None and reference is not candidate:
            reference.close()
        candidate.close()
    rows = [
        {"runner": "llamacpp", "kv_dtype": "f16", "perplexity": tally.perplexity_reference,
         "top1_agreement": 100.0, "kl": 0.0},
        {"runner": candidate.name, "kv_dtype": config.cache.kv_dtype, "perplexity": tally.perplexity_candidate,
         "top1_agreement": tally.top1_agreement, "kl": tally.mean_kl},
    ]
    report = {
        "model": Path(config.model_path).name,
        "text": text_name,
        "num_tokens": len(token_ids),
        "num_predictions": tally.num_predictions,
        "threads": config.threads,  # no engine, so no chooser: both runners ran on this count throughout
        "candidate_is_reference": is_same,
        "reference": rows[0],
        "candidate": rows[1],
        "seconds": time.perf_counter() - t0,
    }
    if as_json:
        print(json.dumps(report))
    else:
        _print_table(report)
    return 0


def _print_table(report: dict) -> None:
    print(f"{report['model']} · {report['text']}, {report['num_tokens']:,} tokens · "
          f"{report['threads']} threads · {report['seconds']:.1f} s")
    print(f"{'':11}{'runner':11}{'KV':6}{'perplexity':>12}{'top-1 agreement':>18}{'KL(ref || this)':>18}")
    for label in ("reference", "candidate"):
        row = report[label]
        print(f"{label:11}{_RUNNER_NAMES.get(row['runner'], row['runner']):11}{row['kv_dtype']:6}"
              f"{row['perplexity']:>12.4f}{row['top1_agreement']:>16.2f} %{row['kl']:>18.6f}")

"""`localllm run`: complete one prompt, streaming to stdout, one timing line to stderr."""

from __future__ import annotations

import json
import sys
import time

from localllm.config import EngineConfig
from localllm.engine.request import SamplingParams
from localllm.errors import NoChatTemplateError


def timing_line(metrics) -> str:
    ttft = f"{metrics.ttft * 1000:.0f} ms" if metrics.ttft is not None else "-"
    prefill = metrics.prefill_tokens_per_s
    decode = metrics.decode_tokens_per_s
    return (
        f"TTFT {ttft} · prompt {metrics.num_prompt_tokens} tokens "
        f"({metrics.num_cached_tokens} cached{_disk(metrics)}) at {prefill or 0:.1f} tokens/s · "
        f"{metrics.num_generated_tokens} generated at {decode or 0:.1f} tokens/s · "
        f"finish {metrics.finish_reason}"
    )


def _disk(metrics) -> str:
    return f", {metrics.num_disk_cached_tokens} from disk" if metrics.num_disk_cached_tokens else ""


def run(config: EngineConfig, prompt: str, params: SamplingParams, chat: bool = False,
        system: str | None = None, as_json: bool = False) -> int:
    from localllm.engine.engine import LLMEngine

    t_load = time.perf_counter()
    engine = LLMEngine(config)
    load_s = time.perf_counter() - t_load
    try:
        if chat:
            messages = ([{"role": "system", "content": system}] if system else [])
            messages.append({"role": "user", "content": prompt})
            try:
                prompt_ids = engine.tokenizer.apply_chat_template(messages)
            except NoChatTemplateError as e:
                raise NoChatTemplateError(f"{e}, or run without --chat to complete a plain prompt") from None
        else:
            prompt_ids = engine.tokenizer.encode(prompt)
        seq = engine.add_request(prompt_ids, params)
        text, metrics, finish = [], None, None
        while engine.has_unfinished:
            for out in engine.step():
                if out.text:
                    text.append(out.text)
                    if not as_json:
                        sys.stdout.write(out.text)
                        sys.stdout.flush()
                if out.finished:
                    metrics, finish = out.metrics, out.finish_reason
        if as_json:
            json.dump({
                "text": "".join(text),
                "finish_reason": finish,
                "prompt_tokens": metrics.num_prompt_tokens,
                "cached_tokens": metrics.num_cached_tokens,
                "disk_cached_tokens": metrics.num_disk_cached_tokens,
                "completion_tokens": metrics.num_generated_tokens,
                "timings": {
                    "load_s": load_s,
                    "ttft_s": metrics.ttft,
                    "tpot_s": metrics.tpot,
                    "prompt_tokens_per_s": metrics.prefill_tokens_per_s,
                    "decode_tokens_per_s": metrics.decode_tokens_per_s,
                },
            }, sys.stdout)
            sys.stdout.write("\n")
        else:
            sys.stdout.write("\n")
            print(timing_line(metrics), file=sys.stderr)
        del seq
        return 0
    finally:
        engine.close()

"""The chat app's status bar text, from an answer's figures (no screen, no model)."""

from __future__ import annotations

from localllm.tui.backend import Chunk, EngineFigures, Figures
from localllm.tui.widgets.status_bar import StatusBar


def _bar(answer: Figures | dict) -> StatusBar:
    bar = StatusBar()
    bar.set_state("ready", model="qwen2.5-coder-0.5b.gguf")
    bar.set_engine(EngineFigures(kv_used=0, kv_cached=0, kv_total=4096, num_running=0, num_waiting=0))
    bar.set_answer(answer)
    return bar


def _answer(**last) -> Figures:
    f = Figures(start=10.0)
    f.observe(Chunk("Hel", 1, prompt_tokens=40, cached_tokens=32), now=10.5)
    f.observe(Chunk("lo", 1), now=11.0)
    f.observe(Chunk(finished=True, finish_reason="stop", **last), now=11.0)
    return f


def test_status_bar_shows_the_draft_acceptance_of_an_answer_that_drafted():
    bar = _bar(_answer(num_draft_proposed=1430, num_draft_accepted=1412))
    assert bar.render_text() == ("qwen2.5-coder-0.5b · ready │ TTFT 500 ms │ 2.0 tok/s │ draft 1,412/1,430 │ "
                                 "prompt 40 / cached 32 │ KV 0% of 4,096")


def test_status_bar_leaves_the_draft_out_when_nothing_was_proposed():
    expected = "qwen2.5-coder-0.5b · ready │ TTFT 500 ms │ 2.0 tok/s │ prompt 40 / cached 32 │ KV 0% of 4,096"
    assert _bar(_answer(num_draft_proposed=0, num_draft_accepted=0)).render_text() == expected  # sampled, --no-spec
    assert _bar(_answer()).render_text() == expected  # a remote server: not known
    saved = {"ttft": 0.5, "tokens_per_s": 2.0, "tokens": 2, "prompt_tokens": 40, "cached_tokens": 32,
             "finish_reason": "stop"}  # an answer saved before drafts were counted
    assert _bar(saved).render_text() == expected

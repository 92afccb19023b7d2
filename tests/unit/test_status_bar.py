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


def test_status_bar_ends_with_the_threads_decode_runs_on():
    bar = _bar(_answer())
    head = "qwen2.5-coder-0.5b · ready │ TTFT 500 ms │ 2.0 tok/s │ prompt 40 / cached 32 │ KV 0% of 4,096"
    for threads, threads_max, tail in ((2, 2, " │ 2 threads"), (1, 2, " │ 1/2 threads"),
                                       (1, 1, " │ 1 thread"), (3, 8, " │ 3/8 threads"),
                                       (0, 0, "")):  # a GPU computes the steps: no CPU threads to show
        bar.set_engine(EngineFigures(kv_used=0, kv_cached=0, kv_total=4096, num_running=0, num_waiting=0,
                                     threads=threads, threads_max=threads_max))
        assert bar.render_text() == head + tail
    bar.set_engine(None)  # a remote server: not known
    assert bar.render_text() == head.replace("KV 0% of 4,096", "KV -")


def test_a_narrow_status_bar_leaves_whole_parts_out_from_the_end():
    bar = _bar(_answer())
    bar.set_engine(EngineFigures(kv_used=0, kv_cached=0, kv_total=4096, num_running=0, num_waiting=0,
                                 threads=2, threads_max=2))
    full = bar.render_text()
    assert bar.render_text(len(full)) == full
    assert bar.render_text(len(full) - 1) == full.removesuffix(" │ 2 threads")  # not "│ 2 thread"
    assert bar.render_text(40) == "qwen2.5-coder-0.5b · ready │ TTFT 500 ms"
    assert bar.render_text(5) == "qwen2.5-coder-0.5b · ready"  # the model and state stay, cut by the screen

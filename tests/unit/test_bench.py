"""`localllm bench`'s text report, from figures alone (no model)."""

from __future__ import annotations

from localllm.commands.bench import _report, draft_text


def test_draft_text_is_accepted_of_proposed_and_the_rate():
    assert draft_text(430, 412) == " | draft 412/430 (96%)"
    assert draft_text(0, 0) == ""  # --no-spec, or sampled requests
    assert draft_text(None, None) == ""  # a server (--url) does not say


def test_report_line_ends_with_the_drafts(capsys):
    run = {"concurrency": 4, "output_tokens_per_s": 120.4, "decode_tokens_per_s": 150.0, "ttft_p50_s": 0.1,
           "ttft_p95_s": 0.2, "tpot_p50_s": 0.02, "tpot_p95_s": 0.03, "draft_proposed": 40, "draft_accepted": 30}
    _report([run, {**run, "draft_proposed": 0, "draft_accepted": 0}], {}, as_json=False)
    head = ("concurrency   4:   120.4 output tok/s,   150.0 decode tok/s | TTFT p50     100 ms p95     200 ms | "
            "TPOT p50   20.0 ms p95   30.0 ms")
    assert capsys.readouterr().out == f"{head} | draft 30/40 (75%)\n{head}\n"

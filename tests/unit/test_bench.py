"""`localllm bench`'s text report, from figures alone (no model)."""

from __future__ import annotations

from localllm.commands.bench import _report, draft_text, threads_text


def test_draft_text_is_accepted_of_proposed_and_the_rate():
    assert draft_text(430, 412) == " | draft 412/430 (96%)"
    assert draft_text(0, 0) == ""  # --no-spec, or sampled requests
    assert draft_text(None, None) == ""  # a server (--url) does not say


def test_threads_text_is_the_count_of_each_kind_of_step():
    assert threads_text(2, 2) == " | threads 2 decode, 2 prefill"
    assert threads_text(1, 2) == " | threads 1 decode, 2 prefill"  # the load took a core from decode
    assert threads_text(0, 0) == ""  # a GPU computed the steps
    assert threads_text(None, None) == ""  # a server (--url) does not say


def test_report_line_ends_with_the_drafts(capsys):
    run = {"concurrency": 4, "output_tokens_per_s": 120.4, "decode_tokens_per_s": 150.0, "ttft_p50_s": 0.1,
           "ttft_p95_s": 0.2, "tpot_p50_s": 0.02, "tpot_p95_s": 0.03, "draft_proposed": 40, "draft_accepted": 30}
    _report([run, {**run, "draft_proposed": 0, "draft_accepted": 0}], {}, as_json=False)
    head = ("concurrency   4:   120.4 output tok/s,   150.0 decode tok/s | TTFT p50     100 ms p95     200 ms | "
            "TPOT p50   20.0 ms p95   30.0 ms")
    assert capsys.readouterr().out == f"{head} | draft 30/40 (75%)\n{head}\n"
    _report([{**run, "threads_decode": 1, "threads_prefill": 2}], {}, as_json=False)
    assert capsys.readouterr().out == f"{head} | threads 1 decode, 2 prefill | draft 30/40 (75%)\n"


def _sse(*events: dict) -> bytes:
    import json

    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def _stream(body: bytes) -> dict:
    import asyncio

    import httpx

    from localllm.commands.bench import _stream_one

    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        seen.update(json.loads(request.content))
        return httpx.Response(200, content=body, headers={"content-type": "text/event-stream"})

    async def main():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await _stream_one(client, "http://x/v1", "m", "hi", 8, {})

    result = asyncio.run(main())
    assert seen["stream_options"] == {"include_usage": True}
    return result


def test_a_url_stream_counts_the_servers_tokens_not_its_chunks():
    """A chunk holds several tokens where a step accepted drafts: the server's usage counts them."""
    chunk = {"choices": [{"text": " two tokens"}]}
    result = _stream(_sse(chunk, chunk, chunk, {"choices": [], "usage": {"completion_tokens": 6}}))
    assert result["tokens"] == 6 and len(result["times"]) == 3
    assert result["tpot"] == (result["times"][-1] - result["times"][0]) / 5


def test_a_url_stream_without_usage_counts_chunks():
    chunk = {"choices": [{"text": "x"}]}
    assert _stream(_sse(chunk, chunk, {"choices": [{"text": ""}]}))["tokens"] == 2

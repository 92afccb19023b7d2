"""/metrics's exposition of the engine's figures, from EngineStats alone (no server, no model)."""

from __future__ import annotations

import dataclasses

from prometheus_client.parser import text_string_to_metric_families

from localllm.engine.metrics import EngineStats
from localllm.server.metrics import ServerMetrics


def _stats(num_draft_proposed: int, num_draft_accepted: int) -> EngineStats:
    return EngineStats(num_waiting=0, num_running=1, num_blocks_used=3, num_blocks_total=256, num_blocks_cached=2,
                       num_preemptions=0, num_steps=9, num_prompt_tokens_computed=40, num_tokens_generated=12,
                       num_draft_proposed=num_draft_proposed, num_draft_accepted=num_draft_accepted)


def _drafts(body: bytes) -> dict[str, tuple[str, float]]:
    return {f.name: (f.type, s.value) for f in text_string_to_metric_families(body.decode())
            for s in f.samples if f.name.startswith("localllm_draft") and s.name.endswith("_total")}


def test_draft_counters_follow_the_engine_stats_at_each_scrape():
    m = ServerMetrics()
    body, _ = m.render(_stats(0, 0))
    assert "# TYPE localllm_draft_tokens_proposed_total counter" in body.decode().splitlines()
    assert _drafts(body) == {"localllm_draft_tokens_proposed": ("counter", 0.0),
                             "localllm_draft_tokens_accepted": ("counter", 0.0)}
    body, _ = m.render(_stats(430, 412))
    assert _drafts(body) == {"localllm_draft_tokens_proposed": ("counter", 430.0),
                             "localllm_draft_tokens_accepted": ("counter", 412.0)}


def test_leak_gauges_show_in_flight_requests_and_runner_sequences():
    stats = EngineStats(num_waiting=0, num_running=2, num_blocks_used=7, num_blocks_total=256, num_blocks_cached=0,
                        num_preemptions=0, num_steps=1, num_prompt_tokens_computed=0, num_tokens_generated=0,
                        num_runner_seqs=2)
    body, _ = ServerMetrics().render(stats, num_in_flight=3)
    gauges = {f.name: (f.type, s.value) for f in text_string_to_metric_families(body.decode())
              for s in f.samples if f.name in ("localllm_requests_in_flight", "localllm_kv_runner_sequences")}
    assert gauges == {"localllm_requests_in_flight": ("gauge", 3.0), "localllm_kv_runner_sequences": ("gauge", 2.0)}


def _threads(stats: EngineStats) -> dict[str, float]:
    body, _ = ServerMetrics().render(stats)
    return {(f'{s.name}{{kind="{s.labels["kind"]}"}}' if s.labels else s.name): s.value
            for f in text_string_to_metric_families(body.decode()) if f.name.startswith("localllm_cpu_threads")
            for s in f.samples}


def test_thread_gauges_show_the_counts_steps_run_on_and_whether_they_adapt():
    adaptive = dataclasses.replace(_stats(0, 0), threads_decode=3, threads_prefill=8, threads_max=8,
                                   threads_adaptive=True)
    assert _threads(adaptive) == {'localllm_cpu_threads{kind="decode"}': 3.0,
                                  'localllm_cpu_threads{kind="prefill"}': 8.0,
                                  "localllm_cpu_threads_max": 8.0, "localllm_cpu_threads_adaptive": 1.0}
    on_a_gpu = _stats(0, 0)  # no thread figures: the CPU does not compute the steps
    assert _threads(on_a_gpu) == {'localllm_cpu_threads{kind="decode"}': 0.0,
                                  'localllm_cpu_threads{kind="prefill"}': 0.0,
                                  "localllm_cpu_threads_max": 0.0, "localllm_cpu_threads_adaptive": 0.0}

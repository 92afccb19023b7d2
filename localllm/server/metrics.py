"""Prometheus figures of the server and the engine (the only prometheus_client import).
Each app gets its own registry: nothing global, nothing created at import."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from localllm.engine.metrics import EngineStats, RequestMetrics

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)
_LOAD_BUCKETS = (0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128)


class _EngineCounters:
    """Counters the engine keeps itself (EngineStats), exposed as they stand at the scrape:
    they also count the drafts of requests that are still running."""

    def __init__(self):
        self.num_draft_proposed = 0
        self.num_draft_accepted = 0

    def collect(self):
        yield CounterMetricFamily("localllm_draft_tokens_proposed", "Prompt-lookup draft tokens checked by the model",
                                  value=self.num_draft_proposed)
        yield CounterMetricFamily("localllm_draft_tokens_accepted", "Draft tokens the model agreed with",
                                  value=self.num_draft_accepted)


class _ModelFigures:
    """The model manager's figures per model (label ``model``), as they stand at the scrape."""

    def __init__(self):
        self.status: list = []  # manager.ModelStatus of every served model

    def collect(self):
        loaded = GaugeMetricFamily("localllm_model_loaded", "1: the model is loaded now", labels=["model"])
        size = GaugeMetricFamily("localllm_model_bytes", "Memory planned for the loaded model (weights and KV)",
                                 labels=["model"])
        in_flight = GaugeMetricFamily("localllm_model_requests_in_flight", "Requests holding the model",
                                      labels=["model"])
        loads = CounterMetricFamily("localllm_model_loads", "Times the model was loaded", labels=["model"])
        unloads = CounterMetricFamily("localllm_model_unloads", "Times the model was unloaded", labels=["model"])
        for s in self.status:
            loaded.add_metric([s.name], int(s.loaded))
            size.add_metric([s.name], s.bytes)
            in_flight.add_metric([s.name], s.in_flight)
            loads.add_metric([s.name], s.num_loads)
            unloads.add_metric([s.name], s.num_unloads)
        yield from (loaded, size, in_flight, loads, unloads)


class ServerMetrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("localllm_time_to_first_token_seconds", "Time to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.tpot = Histogram("localllm_time_per_output_token_seconds", "Mean time per output token after the first",
                              registry=r, buckets=_TPOT_BUCKETS)
        self.e2e = Histogram("localllm_e2e_request_latency_seconds", "Arrival to finish", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self.requests = Counter("localllm_requests", "Finished requests by finish reason", ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("localllm_prompt_tokens", "Prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("localllm_cached_prompt_tokens", "Prompt tokens served from the prefix cache",
                                     registry=r)
        self.disk_cached_tokens = Counter("localllm_disk_cached_prompt_tokens",
                                          "Prompt tokens loaded from the on-disk prefix cache", registry=r)
        self.generated_tokens = Counter("localllm_generation_tokens", "Generated tokens", registry=r)
        self.waiting = Gauge("localllm_requests_waiting", "Sequences waiting to run", registry=r)
        self.running = Gauge("localllm_requests_running", "Sequences running", registry=r)
        self.blocks_used = Gauge("localllm_kv_blocks_used", "KV cache blocks in use", registry=r)
        self.blocks_total = Gauge("localllm_kv_blocks_total", "KV cache blocks in all", registry=r)
        self.blocks_cached = Gauge("localllm_kv_blocks_cached", "KV blocks holding a reusable prefix", registry=r)
        self.in_flight = Gauge("localllm_requests_in_flight",
                               "Sequences admitted by the server and not yet ended (what --max-queue counts)",
                               registry=r)
        self.runner_seqs = Gauge("localllm_kv_runner_sequences",
                                 "Sequences the model runner holds KV storage for (llama.cpp slots)", registry=r)
        self.preemptions = Gauge("localllm_preemptions_total", "Sequences preempted and recomputed", registry=r)
        # The CPU threads of the steps (engine/threads.py); all 0 where a GPU computes them.
        self.cpu_threads = Gauge("localllm_cpu_threads", "CPU threads steps of this kind run on now", ["kind"],
                                 registry=r)
        self.cpu_threads_max = Gauge("localllm_cpu_threads_max", "The most CPU threads a step may run on",
                                     registry=r)
        self.cpu_threads_adaptive = Gauge("localllm_cpu_threads_adaptive",
                                          "1: threads follow the machine's load; 0: fixed by --threads", registry=r)
        self.engine_counters = _EngineCounters()
        r.register(self.engine_counters)
        self.models = _ModelFigures()
        r.register(self.models)
        self.load_seconds = Histogram("localllm_model_load_seconds", "Seconds each load of the model took",
                                      ["model"], registry=r, buckets=_LOAD_BUCKETS)

    def observe_load(self, entry, seconds: float) -> None:
        """A model manager's on_load: one load of ``entry`` took ``seconds``."""
        self.load_seconds.labels(entry.name).observe(seconds)

    def observe(self, m: RequestMetrics | None) -> None:
        if m is None:
            return
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        if m.tpot is not None:
            self.tpot.observe(m.tpot)
        if m.e2e is not None:
            self.e2e.observe(m.e2e)
        self.requests.labels(m.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.cached_tokens.inc(m.num_cached_tokens)
        self.disk_cached_tokens.inc(m.num_disk_cached_tokens)
        self.generated_tokens.inc(m.num_generated_tokens)

    def render(self, stats: EngineStats, num_in_flight: int = 0, models: list | None = None) -> tuple[bytes, str]:
        """The text of a scrape: ``stats`` of the loaded models' engines together (app.sum_stats),
        ``models`` the manager's status of each served model."""
        self.models.status = list(models or ())
        self.waiting.set(stats.num_waiting)
        self.in_flight.set(num_in_flight)
        self.runner_seqs.set(stats.num_runner_seqs)
        self.running.set(stats.num_running)
        self.blocks_used.set(stats.num_blocks_used)
        self.blocks_total.set(stats.num_blocks_total)
        self.blocks_cached.set(stats.num_blocks_cached)
        self.preemptions.set(stats.num_preemptions)
        self.cpu_threads.labels("decode").set(stats.threads_decode)
        self.cpu_threads.labels("prefill").set(stats.threads_prefill)
        self.cpu_threads_max.set(stats.threads_max)
        self.cpu_threads_adaptive.set(int(stats.threads_adaptive))
        self.engine_counters.num_draft_proposed = stats.num_draft_proposed
        self.engine_counters.num_draft_accepted = stats.num_draft_accepted
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

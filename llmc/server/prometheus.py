"""`GET /metrics`: the engine's state and its requests' latencies in Prometheus' text format.

Names are vLLM's, so dashboards and load-aware routers built for vLLM read llmc as they are.
Latencies come from `llmc.runtime.metrics.RequestTimes`, the one place they are defined; gauges
are read from the engine when scraped.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmc.runtime.request import RequestOutput

# Buckets in seconds, fine at the low end: a small model's tokens come in well under a millisecond.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                    5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineState:
    """Gauges and cumulative counters read from the engine at scrape time."""

    def __init__(self, engine, model: str):
        self.engine, self.labels = engine, {"model_name": model}

    def collect(self):
        engine, labels = self.engine, self.labels
        llm = engine.llm
        scheduler, blocks = llm.scheduler, llm.blocks

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=list(labels))
            g.add_metric(list(labels.values()), value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=list(labels))
            c.add_metric(list(labels.values()), value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", len(scheduler.running))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", engine.num_waiting)
        yield gauge("vllm:kv_cache_usage_perc", "Share of KV-cache blocks in use (1 = full).", blocks.usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      blocks.stats.queried_tokens)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", blocks.stats.hit_tokens)
        yield counter("vllm:num_preemptions", "Requests preempted (their cache freed, recomputed later).",
                      scheduler.num_preemptions)
        # Counted by the engine as it works, as vLLM counts them: an aborted request's tokens are
        # the ones the engine generated, not the ones its client read.
        yield counter("vllm:prompt_tokens", "Prompt tokens prefilled (each request once).", llm.core.prompt_tokens)
        yield counter("vllm:generation_tokens", "Tokens generated.", llm.core.generated_tokens)


class ServerMetrics:
    def __init__(self, engine, model: str):
        """`engine`: the AsyncLLM whose state the gauges read."""
        self.registry = CollectorRegistry()
        self.registry.register(_EngineState(engine, model))
        labels = ["model_name"]
        r = self.registry

        def histogram(name, doc):
            return Histogram(name, doc, labels, buckets=_LATENCY_BUCKETS, registry=r).labels(model)

        self.ttft = histogram("vllm:time_to_first_token_seconds", "Time to first token (arrival to first token).")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Gaps between consecutive output tokens.")
        self.tpot = histogram("vllm:request_time_per_output_token_seconds", "Per request: (E2E - TTFT) / (n - 1).")
        self.e2e = histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.")
        self.queue = histogram("vllm:request_queue_time_seconds", "Arrival to first scheduling.")
        self.success = Counter("vllm:request_success", "Finished requests, by why they ended.",
                               labels + ["finished_reason"], registry=r)
        self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Speculative tokens proposed and verified.",
                                    labels, registry=r).labels(model)
        self.accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Speculative tokens accepted.",
                                       labels, registry=r).labels(model)
        self.model = model

    def finished(self, out: RequestOutput) -> None:
        """Count a request that ended (any reason); its latencies if it produced tokens."""
        m = out.metrics
        self.success.labels(self.model, out.finish_reason or "abort").inc()
        self.draft_tokens.inc(m.proposed_tokens)
        self.accepted_tokens.inc(m.accepted_tokens)
        for histogram, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e),
                                 (self.queue, m.queue_time)):
            if value is not None:
                histogram.observe(value)
        for gap in m.itl:
            self.itl.observe(gap)

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The server's Prometheus metrics (GET /metrics), under vLLM's names where vLLM has one, in a registry of the
server's own (two servers in one process do not share counters).

    vllm:num_requests_running / _waiting            gauges, read from the engine at scrape time
    vllm:prompt_tokens_total / generation_tokens_total
                                                    counters, tokens of finished requests (prompt; generated,
                                                    counted as the client was answered)
    vllm:request_success_total{finished_reason}     counter, requests answered (stop, length, abort)
    vllm:time_to_first_token_seconds                histogram: request arrival -> first generated token
    vllm:time_per_output_token_seconds              histogram, one value per request: (last - first token time)
                                                    / (generated tokens - 1)
    vllm:e2e_request_latency_seconds                histogram: arrival -> last token
    vllm:spec_decode_num_drafts_total               counter: draft/verify rounds (per request row)
    vllm:spec_decode_num_draft_tokens_total         counter: draft tokens proposed
    vllm:spec_decode_num_accepted_tokens_total      counter: draft tokens accepted
    vllm:spec_decode_num_accepted_tokens_per_pos_total{position}
                                                    counter: accepted drafts at position j (0-based)
    qwen_mtp:spec_decode_acceptance_length          gauge: 1 + accepted / drafts (tokens per round)
    qwen_mtp:spec_decode_alpha{position}            gauge: alpha_j, Wind-MTP's conditional acceptance: of the
                                                    rounds that tested draft j, the share that accepted it

The engine's figures come from a callable returning a dict (see `engine_snapshot` in http.py): running, waiting,
spec_drafts, spec_draft_tokens, spec_accepted_tokens, spec_accepted_per_pos (a list), and optionally spec_alpha
and spec_acceptance_length (else derived from the counts).
"""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0)
_TPOT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
                 1.0, 2.5)
_E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class _EngineCollector:
    """The figures the engine keeps, read when /metrics is scraped."""

    def __init__(self, model_name: str, snapshot):
        self.model_name, self.snapshot = model_name, snapshot

    def collect(self):
        s = self.snapshot() or {}
        labels, name = ["model_name"], [self.model_name]

        def gauge(metric, doc, value):
            g = GaugeMetricFamily(metric, doc, labels=labels)
            g.add_metric(name, float(value))
            return g

        def counter(metric, doc, value):
            c = CounterMetricFamily(metric, doc, labels=labels)
            c.add_metric(name, float(value))
            return c

        yield gauge("vllm:num_requests_running", "Requests in an engine slot.", s.get("running", 0))
        yield gauge("vllm:num_requests_waiting", "Requests waiting for a slot.", s.get("waiting", 0))
        drafts, proposed = s.get("spec_drafts", 0), s.get("spec_draft_tokens", 0)
        accepted, per_pos = s.get("spec_accepted_tokens", 0), list(s.get("spec_accepted_per_pos", ()))
        yield counter("vllm:spec_decode_num_drafts", "Draft/verify rounds (per request).", drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", proposed)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", accepted)
        pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted draft tokens at each "
                                  "draft position (0-based).", labels=labels + ["position"])
        alpha = GaugeMetricFamily("qwen_mtp:spec_decode_alpha", "alpha_j: of the rounds that tested draft j (0-based), "
                                  "the share that accepted it.", labels=labels + ["position"])
        alphas = s.get("spec_alpha")
        if alphas is None:  # no conditional figures: those follow from the counts (the tested = the passed before)
            alphas = [a / r if r else 0.0 for a, r in zip(per_pos, [drafts, *per_pos])]
        for j, a in enumerate(per_pos):
            pos.add_metric(name + [str(j)], float(a))
        for j, a in enumerate(alphas):
            alpha.add_metric(name + [str(j)], float(a))
        yield pos
        yield alpha
        length = s.get("spec_acceptance_length")
        if length is None:
            length = 1.0 + accepted / drafts if drafts else 0.0
        yield gauge("qwen_mtp:spec_decode_acceptance_length", "Mean tokens committed per draft/verify round: "
                    "1 + accepted / rounds.", length)


class ServerMetrics:
    """The counters and histograms the server updates per request, and `render()` for GET /metrics."""

    def __init__(self, model_name: str, snapshot=None):
        self.model_name = model_name
        disable_created_metrics()  # no *_created series (as vLLM): process-wide, prometheus_client's only switch
        self.registry = CollectorRegistry()
        kw = {"labelnames": ["model_name"], "registry": self.registry}
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens of answered requests.", **kw)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens answered.", **kw)
        self.success = Counter("vllm:request_success", "Requests answered, by finish reason.",
                               labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=_TTFT_BUCKETS, **kw)
        self.tpot = Histogram("vllm:time_per_output_token_seconds", "Per request: time between its first and "
                              "last token over its generated tokens - 1.", buckets=_TPOT_BUCKETS, **kw)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.", buckets=_E2E_BUCKETS,
                             **kw)
        if snapshot is not None:
            self.registry.register(_EngineCollector(model_name, snapshot))

    def finished(self, *, prompt_tokens: int, generated: int, reason: str, arrival: float, first: float | None,
                 last: float | None) -> None:
        """One request answered (or abandoned): its token counts and times (time.perf_counter() values)."""
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(generated)
        self.success.labels(m, reason).inc()
        if first is not None:
            self.ttft.labels(m).observe(first - arrival)
        if last is not None:
            self.e2e.labels(m).observe(last - arrival)
            if generated > 1 and first is not None:
                self.tpot.labels(m).observe((last - first) / (generated - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)

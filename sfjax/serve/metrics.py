"""Prometheus metrics with vLLM's names under an ``sfjax:`` prefix.

Gauges and counters the engine already keeps (running / waiting requests, KV blocks, prompt and
generation tokens, preemptions, speculation counters) are read at scrape time from the
``AsyncLLM``'s snapshot of its last step, so nothing is counted twice; latency histograms (TTFT,
inter-token latency, TPOT, end to end, queue time) are observed by ``record``, an ``AsyncLLM`` stat
logger, from each output's timings.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


class _Snapshot:
    """A collector of the engine's own counters, as of the AsyncLLM's last step."""

    def __init__(self, engine, labels: dict):
        self.engine, self.labels = engine, labels

    def collect(self):
        s, names, values = self.engine.snapshot(), list(self.labels), list(self.labels.values())

        def gauge(name, doc, value):
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name, doc, value):
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        total = max(s["kv_blocks_total"], 1)
        yield gauge("sfjax:num_requests_running", "Requests in the running batch.", s["num_running"])
        yield gauge("sfjax:num_requests_waiting", "Requests waiting for a slot.", s["num_waiting"])
        yield gauge("sfjax:num_requests_live", "Requests admitted and not yet finished (AsyncLLM).",
                    self.engine.num_live_requests)
        yield gauge("sfjax:kv_cache_usage_perc", "KV cache usage: 1 means every block is held.",
                    1.0 - s["kv_blocks_free"] / total)
        yield gauge("sfjax:kv_cache_free_blocks", "KV blocks free (prefix-cached ones included).",
                    s["kv_blocks_free"])
        yield gauge("sfjax:kv_cache_total_blocks", "KV blocks in the cache (null block excluded).",
                    s["kv_blocks_total"])
        yield counter("sfjax:prompt_tokens", "Prefill tokens processed.", s["stats"]["prompt_tokens"])
        yield counter("sfjax:generation_tokens", "Generation tokens processed.",
                      s["stats"]["generation_tokens"])
        yield counter("sfjax:num_preemptions", "Preemptions (by recompute).", s["num_preemptions"])
        spec = s["spec_decode"]
        if spec is None:
            return
        yield counter("sfjax:spec_decode_num_drafts", "Speculative drafts.", spec["num_drafts"])
        yield counter("sfjax:spec_decode_num_draft_tokens", "Draft tokens proposed.",
                      spec["num_draft_tokens"])
        yield counter("sfjax:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                      spec["num_accepted_tokens"])
        yield counter("sfjax:spec_decode_num_accepted_copy_tokens",
                      "Of the accepted draft tokens, those n-gram lookup copied from the request's "
                      "own tokens (the rest: its table's or a draft's).",
                      spec["num_accepted_copy_tokens"])
        per_pos = CounterMetricFamily("sfjax:spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each position.",
                                      labels=names + ["position"])
        for pos, n in enumerate(spec["accepted_per_pos"]):
            per_pos.add_metric(values + [str(pos)], n)
        yield per_pos


class ServerMetrics:
    """The server's registry; ``record`` is an ``AsyncLLM`` stat logger (engine thread)."""

    def __init__(self, engine, model_name: str):
        self.registry = CollectorRegistry()
        self.labels = {"model_name": model_name}
        names = list(self.labels)

        def hist(name, doc, buckets):
            return Histogram(name, doc, names, buckets=buckets, registry=self.registry).labels(
                **self.labels)

        self.ttft = hist("sfjax:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("sfjax:inter_token_latency_seconds", "Time between token deliveries.",
                        TOKEN_BUCKETS)
        self.tpot = hist("sfjax:request_time_per_output_token_seconds",
                         "Per request: (latency - TTFT) / (output tokens - 1).", TOKEN_BUCKETS)
        self.e2e = hist("sfjax:e2e_request_latency_seconds", "End-to-end request latency.",
                        REQUEST_BUCKETS)
        self.queue = hist("sfjax:request_queue_time_seconds", "Time waiting before the first "
                          "schedule.", REQUEST_BUCKETS)
        self.success = Counter("sfjax:request_success", "Finished requests, by finish reason.",
                               names + ["finished_reason"], registry=self.registry)
        self.registry.register(_Snapshot(engine, self.labels))
        self._last: dict[str, float] = {}    # request id -> its last delivery time

    def record(self, outputs, snapshot: dict) -> None:
        now = snapshot.get("time", time.monotonic())
        for out in outputs:
            m, rid = out.metrics, out.request_id
            if out.new_token_ids and m is not None:
                if rid in self._last:
                    self.itl.observe(now - self._last[rid])
                elif m.first_token_time is not None:
                    self.ttft.observe(m.first_token_time - m.arrival_time)
                    if m.first_scheduled_time is not None:
                        self.queue.observe(m.first_scheduled_time - m.arrival_time)
                self._last[rid] = now
            if out.finished:
                self._finished(out, now)

    def _finished(self, out, now: float) -> None:
        self._last.pop(out.request_id, None)
        reason = out.outputs[0].finish_reason if out.outputs else "abort"
        self.success.labels(**self.labels, finished_reason=str(reason)).inc()
        m = out.metrics
        if m is None:
            return
        end = m.finished_time or now
        self.e2e.observe(end - m.arrival_time)
        n = len(out.outputs[0].token_ids) if out.outputs else 0
        if n > 1 and m.first_token_time is not None:
            self.tpot.observe((end - m.first_token_time) / (n - 1))

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

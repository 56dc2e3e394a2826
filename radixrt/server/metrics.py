"""Prometheus metrics for /metrics: latencies and token counts from the frontend's view,
scheduler gauges (queues, KV pool, cache) read from the scheduler at scrape time.

One CollectorRegistry per server (no module-level state).
"""

from __future__ import annotations

import time
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from radixrt.frontend.req_state import ReqState
from radixrt.messages import ReqOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# scheduler stat -> (metric name, help)
SCHEDULER_GAUGES = {
    "running": ("radixrt:num_running_reqs", "requests in the running batch"),
    "waiting": ("radixrt:num_queue_reqs", "requests waiting for admission"),
    "kv_usage": ("radixrt:token_usage", "fraction of KV pages in use by requests or the prefix cache"),
    "cache_hit_rate": ("radixrt:cache_hit_rate", "cached prompt tokens / prompt tokens since start"),
    "cached_pages": ("radixrt:cached_pages", "KV pages held by the prefix cache"),
    "evicted_pages": ("radixrt:evicted_pages_total", "KV pages evicted from the prefix cache"),
    "retractions": ("radixrt:retractions_total", "running requests retracted for lack of KV pages"),
}


class _SchedulerCollector:
    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self):
        s = dict(self._stats())
        s["kv_usage"] = 1 - s["free_pages"] / s["num_pages"] if s.get("num_pages") else 0.0
        for key, (name, help_text) in SCHEDULER_GAUGES.items():
            yield GaugeMetricFamily(name, help_text, value=float(s.get(key, 0)))


class ServerMetrics:
    def __init__(self, scheduler_stats: Callable[[], dict[str, float]]) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("radixrt:time_to_first_token_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixrt:inter_token_latency_seconds", "time between output tokens", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("radixrt:e2e_request_latency_seconds", "request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("radixrt:prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("radixrt:generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter("radixrt:cached_tokens", "prompt tokens reused from the prefix cache", registry=r)
        self.requests = Counter("radixrt:requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        r.register(_SchedulerCollector(scheduler_stats))

    def observe(self, state: ReqState, out: ReqOutput) -> None:
        """Called with each output before it is applied to the request's state."""
        now = time.perf_counter()
        if out.new_ids:
            if state.first_token_at is None:
                self.ttft.observe(now - state.created)
            else:
                gap = (now - state.last_token_at) / len(out.new_ids)
                for _ in out.new_ids:
                    self.itl.observe(gap)
            self.generation_tokens.inc(len(out.new_ids))
        if out.finish is not None:
            self.e2e.observe(now - state.created)
            self.prompt_tokens.inc(len(state.prompt_ids))
            self.cached_tokens.inc(out.cached_tokens)
            self.requests.labels(out.finish.type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

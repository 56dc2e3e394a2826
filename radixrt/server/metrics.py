"""Prometheus metrics for /metrics: latencies and token counts from the frontend's view,
scheduler gauges (queues, KV pool, cache) read from the scheduler at scrape time, and the prefix-cache
diagnosis of recent requests (GET /cache_report) read from the frontend at scrape time.

One CollectorRegistry per server (no module-level state).
"""

from __future__ import annotations

import time
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from radixrt.frontend.cache_findings import DIVERGENCE_BUCKETS
from radixrt.frontend.cache_report import divergence_position
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
    "bytes_per_token": ("radixrt:kv_bytes_per_token", "KV pool bytes one token takes (per rank, all layers, with scales)"),
    "host_pages": ("radixrt:host_kv_pages", "pages of the host KV tier (hierarchical cache or swap space)"),
    "host_cached_pages": ("radixrt:host_cached_pages", "host tier pages holding cached KV"),
    "host_swap_pages": ("radixrt:host_swap_pages", "host tier pages holding swapped-out requests"),
    "disk_pages": ("radixrt:disk_kv_pages", "pages of the disk KV tier"),
    "disk_cached_pages": ("radixrt:disk_cached_pages", "disk tier pages holding cached KV"),
    "host_hit_pages": ("radixrt:host_hit_pages_total", "pages loaded back from the host tier instead of recomputed"),
    "disk_hit_pages": ("radixrt:disk_hit_pages_total", "pages loaded back from the disk tier instead of recomputed"),
    "pages_d2h": ("radixrt:pages_device_to_host_total", "pages copied from the device pool to host memory"),
    "pages_h2d": ("radixrt:pages_host_to_device_total", "pages copied from host memory to the device pool"),
    "pages_h2disk": ("radixrt:pages_host_to_disk_total", "pages written from host memory to disk"),
    "pages_d2disk": ("radixrt:pages_device_to_disk_total", "pages written from the device pool to disk"),
    "pages_disk2d": ("radixrt:pages_disk_to_device_total", "pages read from disk into the device pool"),
    "pages_drop": ("radixrt:pages_dropped_from_disk_total", "pages dropped from a full disk tier"),
    "tier_move_seconds": ("radixrt:kv_tier_move_seconds_total", "worker time spent moving pages between tiers"),
    "swaps_out": ("radixrt:swaps_out_total", "retracted requests whose KV was swapped to host memory"),
    "swaps_in": ("radixrt:swaps_in_total", "swapped requests brought back"),
    "recomputed_tokens": ("radixrt:recomputed_tokens_total", "tokens recomputed after retraction"),
    "kv_retention_dropped_pages": ("radixrt:kv_retention_dropped_pages_total",
                                   "KV pages bounded-KV retention policies dropped from running requests"),
    "kv_retention_retained_fraction": ("radixrt:kv_retention_retained_fraction",
                                       "retained / computed KV tokens of the running requests under a retention policy"),
    "kv_retention_peak_pages": ("radixrt:kv_retention_peak_pages", "the most KV pages a request under a retention "
                                "policy held after a step"),
}
RETENTION_REQUESTS = "kv_retention_requests_"  # + policy: admitted requests per retention policy


class _SchedulerCollector:
    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self._stats = stats

    def collect(self):
        s = dict(self._stats())
        s["kv_usage"] = 1 - s["free_pages"] / s["num_pages"] if s.get("num_pages") else 0.0
        for key, (name, help_text) in SCHEDULER_GAUGES.items():
            yield GaugeMetricFamily(name, help_text, value=float(s.get(key, 0)))
        policies = GaugeMetricFamily("radixrt:kv_retention_requests_total",
                                     "requests admitted under each bounded-KV retention policy", labels=["policy"])
        for key, value in s.items():
            if key.startswith(RETENTION_REQUESTS):
                policies.add_metric([key.removeprefix(RETENTION_REQUESTS)], float(value))
        yield policies


class _CacheReportCollector:
    """Gauges from CacheDiagnosis.report() (radixrt/frontend/cache_report.py), over its recent requests."""

    def __init__(self, report: Callable[[], dict[str, Any]]) -> None:
        self._report = report

    def collect(self):
        rep = self._report()
        early = f"share of recent prompts diverging from the cache within their first {rep['first_n']} tokens"
        yield GaugeMetricFamily("radixrt:cache_report_prompts", "recent prompts the cache diagnosis covers",
                                value=rep["prompts"])
        yield GaugeMetricFamily("radixrt:cache_early_divergence_share", early, value=rep["early_divergence_share"])
        causes = GaugeMetricFamily("radixrt:cache_cause_share",
                                   "share of recent prompts showing each cause of cache misses (GET /cache_report)",
                                   labels=["kind"])
        for kind, share in rep["cause_shares"].items():
            causes.add_metric([kind], share)
        yield causes
        yield GaugeMetricFamily("radixrt:cache_shared_prefix_hit_rate",
                                "hit rate of recent prompts that share a system prompt with a recent prompt",
                                value=rep["shared_prefix"]["hit_rate"])


class ServerMetrics:
    def __init__(self, scheduler_stats: Callable[[], dict[str, float]],
                 cache_report: Callable[[], dict[str, Any]] | None = None) -> None:
        """scheduler_stats and cache_report (CacheDiagnosis.report, optional) are read at each scrape."""
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("radixrt:time_to_first_token_seconds", "time to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixrt:inter_token_latency_seconds", "time between output tokens", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("radixrt:e2e_request_latency_seconds", "request latency", buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter("radixrt:prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("radixrt:generation_tokens", "generated tokens", registry=r)
        self.cached_tokens = Counter("radixrt:cached_tokens", "prompt tokens reused from the prefix cache", registry=r)
        self.requests = Counter("radixrt:requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        self.divergence = Histogram("radixrt:cache_divergence_tokens",
                                    "where each prompt diverged from its cached match (fully matched: its length)",
                                    buckets=DIVERGENCE_BUCKETS, registry=r)
        r.register(_SchedulerCollector(scheduler_stats))
        if cache_report is not None:
            r.register(_CacheReportCollector(cache_report))

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
            self.divergence.observe(divergence_position(len(state.prompt_ids), out.cached_tokens))
            self.requests.labels(out.finish.type).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

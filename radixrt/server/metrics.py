"""Prometheus metrics for /metrics (docs/metrics.md lists them): latencies, lengths and token
counts from the frontend's view of each request, the HTTP door's refusals and errors, scheduler
figures (queues, KV pool, memory, tiers, spot checks) read from the scheduler at scrape time,
and the prefix-cache diagnosis of recent requests read from the frontend at scrape time.

Where SGLang 0.5.9 has the same metric it has SGLang's name, type and labels (`model_name`, and
the scheduler's `engine_type`, `tp_rank`, `pp_rank`, `moe_ep_rank`), so SGLang's dashboards
work unchanged; radixrt-only metrics keep the `radixrt:` prefix.

One CollectorRegistry per server (no module-level state).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixrt.frontend.cache_findings import DIVERGENCE_BUCKETS
from radixrt.frontend.cache_report import divergence_position
from radixrt.frontend.req_state import ReqState, cached_tokens_details
from radixrt.messages import CachedTokensDetail, ReqOutput, SchedulerStats

# SGLang's default buckets, with finer ones below them: a small model on a CPU answers in milliseconds
_FINE = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05)
TTFT_BUCKETS = _FINE + (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
ITL_BUCKETS = (0.0005, 0.001) + (0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060,
                                 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0)
E2E_BUCKETS = _FINE + (0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400)
QUEUE_BUCKETS = (0.0, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05) + (
    0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400, 500, 600, 700, 800, 900,
    1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64) + (
    100, 300, 500, 700, 1000, 1500, 2000, 3000, 4000, 5000, 6000, 7000, 8000, 9000, 10000, 12000, 15000, 20000, 22000,
    25000, 30000, 35000, 40000, 66000, 99000, 132000, 300000, 600000, 900000, 1100000)
FRACTION_BUCKETS = tuple(i / 10 for i in range(11))
# SGLang's scheduler labels besides model_name (one unified engine, one pipeline stage; the ranks' figures are rank 0's)
SCHEDULER_LABELS = {"engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}

# scheduler stat -> (SGLang metric name, help): gauges
SGLANG_GAUGES = {
    "running": ("sglang:num_running_reqs", "The number of running requests."),
    "waiting": ("sglang:num_queue_reqs", "The number of requests in the waiting queue."),
    "kv_usage": ("sglang:token_usage", "The token usage (fraction of KV pages held by requests or the prefix cache)."),
    "cache_hit_rate": ("sglang:cache_hit_rate", "The prefix cache hit rate (cached / prompt tokens since start)."),
    "used_tokens": ("sglang:num_used_tokens", "The number of used tokens (KV pages requests hold, in tokens)."),
    "max_total_tokens": ("sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."),
    "spec_accept_length": ("sglang:spec_accept_length", "The average acceptance length of speculative decoding "
                           "(tokens a decode step gains per request)."),
    "spec_accept_rate": ("sglang:spec_accept_rate", "The acceptance rate of speculative decoding (accepted / drafted)."),
}
# scheduler stat -> (radixrt metric name, help): gauges, and counters (names ending in _total)
SCHEDULER_FIGURES = {
    "cached_pages": ("radixrt:cached_pages", "KV pages held by the prefix cache"),
    "used_pages": ("radixrt:kv_used_pages", "KV pages held by requests"),
    "kv_peak_used_pages": ("radixrt:kv_peak_used_pages", "the most KV pages requests held at once since start"),
    "evicted_pages": ("radixrt:evicted_pages_total", "KV pages evicted from the prefix cache"),
    "retractions": ("radixrt:retractions_total", "running requests retracted for lack of KV pages"),
    "requests_refused_no_memory": ("radixrt:requests_refused_no_memory_total",
                                   "requests ended because the KV pool could never hold them"),
    "prefill_cut_steps": ("radixrt:prefill_cut_steps_total", "steps whose prefill tokens were cut so that decoding "
                          "requests keep their cadence (--max-decode-slowdown)"),
    "bytes_per_token": ("radixrt:kv_bytes_per_token", "KV pool bytes one token takes (per rank, all layers, with scales)"),
    "worker_rss_bytes": ("radixrt:worker_rss_bytes", "resident memory of the worker process (rank 0)"),
    "worker_rss_peak_bytes": ("radixrt:worker_rss_peak_bytes", "the worker process's resident-memory high-water mark"),
    "device_memory_allocated_bytes": ("radixrt:device_memory_allocated_bytes", "CUDA memory torch has allocated (rank 0)"),
    "device_memory_reserved_bytes": ("radixrt:device_memory_reserved_bytes", "CUDA memory torch's allocator reserved"),
    "device_memory_peak_bytes": ("radixrt:device_memory_peak_bytes", "the most CUDA memory torch had allocated"),
    "memory_limit_bytes": ("radixrt:memory_limit_bytes", "the OOM line: the GPU's memory, or the host's (cgroup's) on CPU"),
    "host_tier_used_bytes": ("radixrt:host_tier_used_bytes", "host-memory KV tier bytes in use (cache and swap)"),
    "host_tier_capacity_bytes": ("radixrt:host_tier_capacity_bytes", "host-memory KV tier size"),
    "disk_tier_used_bytes": ("radixrt:disk_tier_used_bytes", "disk KV tier bytes in use"),
    "disk_tier_capacity_bytes": ("radixrt:disk_tier_capacity_bytes", "disk KV tier size"),
    "host_pages": ("radixrt:host_kv_pages", "pages of the host KV tier (hierarchical cache or swap space)"),
    "host_cached_pages": ("radixrt:host_cached_pages", "host tier pages holding cached KV"),
    "host_swap_pages": ("radixrt:host_swap_pages", "host tier pages holding swapped-out requests"),
    "disk_pages": ("radixrt:disk_kv_pages", "pages of the disk KV tier"),
    "disk_cached_pages": ("radixrt:disk_cached_pages", "disk tier pages holding cached KV"),
    "host_hit_pages": ("radixrt:host_hit_pages_total", "pages loaded back from the host tier instead of recomputed"),
    "disk_hit_pages": ("radixrt:disk_hit_pages_total", "pages loaded back from the disk tier instead of recomputed"),
    "disk_tier_errors": ("radixrt:disk_tier_errors_total", "disk tier page file operations that failed (the pages "
                         "were recomputed instead)"),
    "disk_tier_enabled": ("radixrt:disk_tier_enabled", "1 while the disk tier is in use; 0 without one, or after "
                          "hicache_disk_max_errors failures in a row turned it off"),
    "pages_d2h": ("radixrt:pages_device_to_host_total", "pages copied from the device pool to host memory"),
    "pages_h2d": ("radixrt:pages_host_to_device_total", "pages copied from host memory to the device pool"),
    "pages_h2disk": ("radixrt:pages_host_to_disk_total", "pages written from host memory to disk"),
    "pages_d2disk": ("radixrt:pages_device_to_disk_total", "pages written from the device pool to disk"),
    "pages_disk2d": ("radixrt:pages_disk_to_device_total", "pages read from disk into the device pool"),
    "pages_drop": ("radixrt:pages_dropped_from_disk_total", "pages dropped from the disk tier (full, lost, or after "
                   "an earlier page of theirs)"),
    "tier_move_seconds": ("radixrt:kv_tier_move_seconds_total", "worker time spent moving pages between tiers"),
    "unreachable_pages": ("radixrt:kv_unreachable_pages", "pages held in the host or disk tier while an earlier page "
                          "of their sequence is held nowhere (no request can read them; 0 by design)"),
    "cascade_dropped_pages": ("radixrt:kv_cascade_dropped_pages_total", "lower-tier pages dropped because an "
                              "earlier page of their sequence left the last tier holding it"),
    "pinned_dropped_pages": ("radixrt:kv_pinned_dropped_pages_total", "pinned pages dropped before their TTL because "
                             "no lower tier could take them (swap reservations filled host memory)"),
    "pinned_pages": ("radixrt:kv_pinned_pages", "pages pinned by cache_control (in any tier, or reserved)"),
    "pin_budget_pages": ("radixrt:kv_pin_budget_pages", "the most pages pins may hold (--max-pinned-fraction)"),
    "pinned_namespaces": ("radixrt:kv_pinned_namespaces", "cache namespaces holding pins"),
    "pins_taken": ("radixrt:kv_pins_total", "requests whose cache_control pin was granted"),
    "pins_refused": ("radixrt:kv_pins_refused_total", "requests refused for passing a pin budget"),
    "pinned_pages_expired": ("radixrt:kv_pinned_pages_expired_total", "pinned pages whose TTL ended"),
    "tier_load_pages": ("radixrt:kv_tier_load_pages_total", "lower-tier pages a request read that were loaded, "
                        "being measured faster to load than to recompute"),
    "tier_recompute_pages": ("radixrt:kv_tier_recompute_pages_total", "lower-tier pages a request read that were "
                             "recomputed instead of loaded, being measured faster to recompute"),
    "cost_h2d_s_per_page": ("radixrt:kv_tier_cost_h2d_seconds_per_page", "measured seconds to copy one KV page from "
                            "host memory to the device (recent moves; 0: not measured)"),
    "cost_disk_s_per_page": ("radixrt:kv_tier_cost_disk_seconds_per_page", "measured seconds to read one KV page from "
                             "disk to the device (recent moves; 0: not measured)"),
    "cost_prefill_s_per_token": ("radixrt:kv_tier_cost_prefill_seconds_per_token", "measured prefill seconds per "
                                 "token at the batch sizes now running, before attention's share (0: not measured)"),
    "swaps_out": ("radixrt:swaps_out_total", "retracted requests whose KV was swapped to host memory"),
    "swaps_in": ("radixrt:swaps_in_total", "swapped requests brought back"),
    "recomputed_tokens": ("radixrt:recomputed_tokens_total", "tokens recomputed after retraction"),
    "kv_retention_dropped_pages": ("radixrt:kv_retention_dropped_pages_total",
                                   "KV pages bounded-KV retention policies dropped from running requests"),
    "kv_retention_retained_fraction": ("radixrt:kv_retention_retained_fraction",
                                       "retained / computed KV tokens of the running requests under a retention policy"),
    "kv_retention_peak_pages": ("radixrt:kv_retention_peak_pages", "the most KV pages a request under a retention "
                                "policy held after a step"),
    "quality_spot_checks": ("radixrt:quality_spot_checks_total", "quality spot checks done"),
    "quality_spot_check_tokens": ("radixrt:quality_spot_check_tokens_total", "emitted tokens the spot checks re-scored"),
    "quality_top1_agreement": ("radixrt:quality_top1_agreement", "share of spot-checked emitted tokens that were the "
                               "reference configuration's top token, since start"),
    "quality_mean_abs_dlogprob": ("radixrt:quality_mean_abs_dlogprob", "mean |live - reference logprob| of the "
                                  "spot-checked emitted tokens, since start"),
    "quality_last_top1_agreement": ("radixrt:quality_last_top1_agreement", "the last spot check's top-1 agreement"),
    "quality_last_mean_abs_dlogprob": ("radixrt:quality_last_mean_abs_dlogprob", "the last spot check's mean |dlogprob|"),
    "quality_spot_checks_pending": ("radixrt:quality_spot_checks_pending", "spot checks waiting for idle time"),
    "spec_draft_tokens": ("radixrt:spec_draft_tokens_total", "draft tokens verified"),
    "spec_accepted_tokens": ("radixrt:spec_accepted_tokens_total", "draft tokens accepted"),
    "spec_verify_steps": ("radixrt:spec_verify_steps_total", "request decode steps on a speculating server"),
    "spec_drafted_steps": ("radixrt:spec_drafted_steps_total", "request decode steps that verified drafts"),
    "spec_tree_steps": ("radixrt:spec_tree_steps_total", "request decode steps that verified a draft tree"),
    "spec_mean_draft_length": ("radixrt:spec_mean_draft_length", "drafts per drafted step, as the cost model chose"),
    "spec_ngram_index_entries": ("radixrt:spec_ngram_index_entries", "entries of the NGRAM index over cached text"),
    "spec_ngram_index_bytes": ("radixrt:spec_ngram_index_bytes", "memory the NGRAM index holds (estimated)"),
    "spec_stale_draft_pages": ("radixrt:spec_stale_draft_pages", "STANDALONE: device pages without their draft KV"),
    "lora_loads": ("radixrt:lora_loads_total", "LoRA adapters read into a worker slot (at first use, after an eviction)"),
    "lora_adapters": ("radixrt:lora_adapters", "LoRA adapters registered (--lora-paths, /load_lora_adapter)"),
    "quality_spot_checks_skipped": ("radixrt:quality_spot_checks_skipped_total",
                                    "spot checks dropped (a full queue, a sequence longer than the reference pool)"),
}
# scheduler stat (a dict field) -> (radixrt counter name, help, label of its keys)
LABELLED = {
    "kv_retention_requests": ("radixrt:kv_retention_requests", "requests admitted under each bounded-KV retention "
                              "policy", "policy"),
    "spec_unspeculated_requests": ("radixrt:spec_unspeculated_requests", "requests a speculating server ran "
                                   "unspeculated, by reason", "reason"),
    "retractions_by_cause": ("radixrt:retractions_by_cause", "running requests that gave their KV pages back, by cause",
                             "cause"),
    "requests_rejected": ("radixrt:requests_rejected", "requests the scheduler answered with a 503 (a full queue, "
                          "outranked, a priority refused, a timeout), by reason", "reason"),
    "lora_requests": ("radixrt:lora_requests", "requests admitted, by LoRA adapter", "adapter"),
    "lora_prompt_tokens": ("radixrt:lora_prompt_tokens", "prompt tokens of admitted requests, by LoRA adapter",
                           "adapter"),
    "lora_cached_tokens": ("radixrt:lora_cached_tokens", "prompt tokens reused from the cache, by LoRA adapter",
                           "adapter"),
    "tenant_requests": ("radixrt:tenant_requests", "requests that reached the scheduler, by tenant", "tenant"),
    "tenant_prompt_tokens": ("radixrt:tenant_prompt_tokens", "prompt tokens of admitted requests, by tenant", "tenant"),
    "tenant_cached_tokens": ("radixrt:tenant_cached_tokens", "prompt tokens reused from the cache, by tenant", "tenant"),
    "tenant_rejected": ("radixrt:tenant_rejected", "requests answered with a 503 by the scheduler, by tenant", "tenant"),
}
# scheduler stat (a dict field) -> (radixrt gauge name, help, label of its keys)
LABELLED_GAUGES = {
    "tenant_waiting": ("radixrt:tenant_waiting_requests", "requests waiting to run, by tenant", "tenant"),
    "tenant_running": ("radixrt:tenant_running_requests", "requests running, by tenant", "tenant"),
    "tenant_cached_pages": ("radixrt:tenant_cached_pages", "device KV pages the cache holds, by the tenant that "
                            "computed them", "tenant"),
}
# figures of the pool computed here from the stats, for SGLang's gauges
DERIVED = ("kv_usage", "used_tokens", "max_total_tokens")
# stats shown by get_server_info only (SchedulerStats.info()); every other field is a metric above
INFO_ONLY = frozenset({
    "num_pages", "free_pages", "evictable_pages", "page_size", "forward_steps", "prompt_tokens",
    "cached_prompt_tokens", "jump_forward_tokens", "weight_updates", "weight_update_pending", "held_for_weight_update",
    "kv_pool_bytes", "page_table_bytes", "weight_bytes", "lora_pool_bytes", "cost_attention_per_position", "cost_prefill_steps",
    "spec_step_seconds_fixed", "spec_step_seconds_per_token", "spec_step_seconds_per_draft",
})


def _family(name: str, help_text: str, value: float, labels: dict[str, str]):
    """A one-sample gauge, or a counter when the name ends in _total."""
    kind = CounterMetricFamily if name.endswith("_total") else GaugeMetricFamily
    fam = kind(name.removesuffix("_total") if kind is CounterMetricFamily else name, help_text, labels=list(labels))
    fam.add_metric(list(labels.values()), value)
    return fam


class _SchedulerCollector:
    def __init__(self, stats: Callable[[], SchedulerStats], model_name: str) -> None:
        self._stats = stats
        self._model = {"model_name": model_name}
        self._sched = {**self._model, **SCHEDULER_LABELS}

    def collect(self):
        s = self._stats()
        derived = {
            "kv_usage": 1 - s.free_pages / s.num_pages if s.num_pages else 0.0,
            "used_tokens": s.used_pages * s.page_size,
            "max_total_tokens": s.num_pages * s.page_size,
        }
        for key, (name, help_text) in SGLANG_GAUGES.items():
            yield _family(name, help_text, float(derived[key] if key in derived else getattr(s, key)), self._sched)
        yield _family("sglang:num_retracted_requests_total", "Total number of retracted requests.",
                      float(s.retractions), self._sched)
        for key, (name, help_text) in SCHEDULER_FIGURES.items():
            yield _family(name, help_text, float(getattr(s, key)), {})
        for table, kind in ((LABELLED, CounterMetricFamily), (LABELLED_GAUGES, GaugeMetricFamily)):
            for key, (name, help_text, label) in table.items():
                fam = kind(name, help_text, labels=[label])
                for value_of, n in getattr(s, key).items():
                    fam.add_metric([value_of], float(n))
                yield fam


class _CacheReportCollector:
    """Gauges from CacheDiagnosis.report() (radixrt/frontend/cache_report.py), over its recent requests.

    Open like the rest of /metrics: the diagnosis compares each request only with texts of its own
    cache namespace, so what one request does to these gauges depends on its own namespace alone
    and tells nobody whether a text is in another tenant's prompts (a right guess moves them exactly
    as a wrong one). They reveal per-request figures of the kind SGLang's cached-fraction and
    prompt-length histograms beside them already do."""

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


def cache_sources(hierarchical: bool, backend: str | None) -> tuple[str, ...]:
    """The cache_source values of sglang:cached_tokens_total a server reports (SGLang 0.5.9's):
    "total" without the hierarchical cache; "device" and "host" with it, and "storage_<backend>"
    with a storage backend (file: the disk tier; mooncake)."""
    if not hierarchical:
        return ("total",)
    return ("device", "host") + ((f"storage_{backend}",) if backend else ())


def cached_by_source(cached: int, details: CachedTokensDetail | None) -> dict[str, int]:
    """One finished request's cached tokens by cache_source, as SGLang counts them: by tier when
    the detail is there (tiers with none left out), else all of them as "total"."""
    if cached <= 0:
        return {}
    d = cached_tokens_details(details)
    if d is None:
        return {"total": cached}
    out = {"device": d["device"], "host": d["host"]}
    if "storage" in d:
        out[f"storage_{d['storage_backend']}"] = d["storage"]
    return {source: n for source, n in out.items() if n > 0}


@dataclass(frozen=True)
class _Labelled:
    """Makes a server's metrics labelled with its model_name (SGLang's label), in its registry."""

    registry: CollectorRegistry
    model_name: str

    def hist(self, name: str, help_text: str, buckets: tuple[float, ...]) -> Histogram:
        return Histogram(name, help_text, ["model_name"], buckets=buckets, registry=self.registry).labels(self.model_name)

    def count(self, name: str, help_text: str) -> Counter:
        return Counter(name, help_text, ["model_name"], registry=self.registry).labels(self.model_name)


class ServerMetrics:
    def __init__(self, scheduler_stats: Callable[[], SchedulerStats],
                 cache_report: Callable[[], dict[str, Any]] | None = None, model_name: str = "",
                 sources: tuple[str, ...] = ("total",)) -> None:
        """scheduler_stats and cache_report (CacheDiagnosis.report, optional) are read at each scrape;
        model_name: the served model name (SGLang's model_name label); sources: the cache_source
        values this server reports (cache_sources), each shown from 0."""
        self.registry = r = CollectorRegistry()
        self.model = model_name
        # NOTE: registered in the order /metrics lists them
        self._add_request_histograms(_Labelled(r, model_name))
        self._add_counters(_Labelled(r, model_name), sources)
        self.divergence = Histogram("radixrt:cache_divergence_tokens",
                                    "where each prompt diverged from its cached match (fully matched: its length)",
                                    buckets=DIVERGENCE_BUCKETS, registry=r)
        r.register(_SchedulerCollector(scheduler_stats, model_name))
        if cache_report is not None:
            r.register(_CacheReportCollector(cache_report))

    def _add_request_histograms(self, m: _Labelled) -> None:
        """Each request's latencies, lengths and cached share."""
        self.ttft = m.hist("sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           TTFT_BUCKETS)
        self.itl = m.hist("sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          ITL_BUCKETS)
        self.e2e = m.hist("sglang:e2e_request_latency_seconds", "Histogram of End-to-end request latency in seconds",
                          E2E_BUCKETS)
        # SGLang's scheduler observes queueing, so it has the scheduler's labels
        self.queue_time = Histogram("sglang:queue_time_seconds", "Histogram of queueing time in seconds.",
                                    ["model_name", *SCHEDULER_LABELS], buckets=QUEUE_BUCKETS,
                                    registry=m.registry).labels(m.model_name, *SCHEDULER_LABELS.values())
        self.prompt_len = m.hist("sglang:prompt_tokens_histogram", "Histogram of prompt token length.", TOKEN_BUCKETS)
        self.output_len = m.hist("sglang:generation_tokens_histogram", "Histogram of generation token length.",
                                 TOKEN_BUCKETS)
        self.tpot = m.hist("radixrt:time_per_output_token_seconds", "each request's mean time between output tokens "
                           "after its first (requests with two or more)", ITL_BUCKETS)
        self.cached_fraction = m.hist("radixrt:request_cached_fraction", "each request's cached prompt tokens / "
                                      "prompt tokens", FRACTION_BUCKETS)

    def _add_counters(self, m: _Labelled, sources: tuple[str, ...]) -> None:
        """Tokens and requests processed, aborts, and the HTTP door's refusals and errors."""
        r = m.registry
        self.prompt_tokens = m.count("sglang:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = m.count("sglang:generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = Counter("sglang:cached_tokens", "Number of cached prompt tokens by source "
                                     "(device/host/storage).", ["model_name", "cache_source"], registry=r)
        for source in sources:
            self.cached_tokens.labels(m.model_name, source)
        self.num_requests = m.count("sglang:num_requests", "Number of requests processed.")
        self.aborted = m.count("sglang:num_aborted_requests", "Number of requests aborted.")
        self.aborted_by_cause = Counter("radixrt:aborted_requests", "requests a client aborted, by cause (abort_request, "
                                        "client_disconnected)", ["cause"], registry=r)
        self.requests = Counter("radixrt:requests", "finished requests by finish reason", ["finish_reason"], registry=r)
        self.refused = Counter("radixrt:refused_requests", "requests answered 4xx, by status and cause (the field "
                               "named, or the kind)", ["status", "cause"], registry=r)
        self.internal_errors = Counter("radixrt:internal_errors", "requests answered 5xx, by status and cause",
                                       ["status", "cause"], registry=r)

    def observe(self, state: ReqState, out: ReqOutput) -> None:
        """Called with each output before it is applied to the request's state."""
        now = time.perf_counter()
        if out.queue_time is not None:
            self.queue_time.observe(out.queue_time)
        if out.new_ids:
            if state.first_token_at is None:
                self.ttft.observe(now - state.created)
            else:
                gap = (now - state.last_token_at) / len(out.new_ids)
                for _ in out.new_ids:
                    self.itl.observe(gap)
            self.generation_tokens.inc(len(out.new_ids))
        if out.finish is not None:
            self._finished(state, out, now)

    def _finished(self, state: ReqState, out: ReqOutput, now: float) -> None:
        prompt, output = len(state.prompt_ids), len(state.output_ids) + len(out.new_ids)
        self.e2e.observe(now - state.created)
        self.prompt_tokens.inc(prompt)
        for source, n in cached_by_source(out.cached_tokens, out.cached_details).items():
            self.cached_tokens.labels(self.model, source).inc(n)
        self.num_requests.inc()
        self.prompt_len.observe(prompt)
        self.output_len.observe(output)
        if prompt:
            self.cached_fraction.observe(out.cached_tokens / prompt)
        first = state.first_token_at if state.first_token_at is not None else now
        if output > 1:  # its last token came now, or with an earlier output when this one only finishes it
            last = now if out.new_ids else state.last_token_at
            self.tpot.observe((last - first) / (output - 1))
        self.divergence.observe(divergence_position(prompt, out.cached_tokens))
        self.requests.labels(out.finish.type).inc()

    def count_aborts(self, n: int, cause: str) -> None:
        """Requests a client aborted (cause: abort_request, or client_disconnected), as SGLang counts them."""
        if n:
            self.aborted.inc(n)
            self.aborted_by_cause.labels(cause).inc(n)

    def count_error(self, status: int, cause: str) -> None:
        """One HTTP error answer: a refusal (4xx) or an internal error (5xx)."""
        (self.refused if status < 500 else self.internal_errors).labels(str(status), cause).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

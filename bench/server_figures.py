"""The server's own figures for one load of bench/serving.py, to print beside the client's.

Latencies come from /metrics: what each histogram observed during the load (a scrape before
it, one after, and their difference: `delta_buckets`), read as P50/P95/P99 the way Prometheus'
histogram_quantile reads them (`radixrt.ops.prom`). That interpolates linearly inside the bucket
holding the percentile, so a server figure agrees with the client's to within that bucket, not
to the millisecond (and the client's also carry the HTTP hop). Queueing is the server's alone:
arrival at the scheduler to the request's first schedule.

KV and memory come from /get_server_info: a thread polls it about every 100 ms while the load
runs and keeps the largest `used_pages` (pages requests held); after the load come the server's
own `kv_peak_used_pages` (since the server started, so across a sweep it is the highest so far),
`num_pages` (the pool) and the worker's RSS and device-memory peaks against `memory_limit_bytes`.

A metric or key the server lacks (an older server) is None in the JSON and "-" in the table.
"""

from __future__ import annotations

import math
from typing import Any

import requests

from radixrt.ops.prom import Scrape, delta_buckets, percentiles

# The table's rows: JSON key (as the client's summary names it) -> (label, histogram).
LATENCIES = {
    "ttft_s": ("TTFT", "sglang:time_to_first_token_seconds"),
    "tpot_s": ("TPOT", "radixrt:time_per_output_token_seconds"),
    "queue_s": ("queue", "sglang:queue_time_seconds"),
    "e2e_s": ("E2E", "sglang:e2e_request_latency_seconds"),
}
# get_server_info keys read once after the load.
PEAK_KEYS = ("kv_peak_used_pages", "num_pages", "worker_rss_peak_bytes", "device_memory_peak_bytes",
             "memory_limit_bytes")
POLL_S = 0.1  # how often bench/serving.py polls get_server_info during a load
NO_FIGURES = {"p50": None, "p95": None, "p99": None}


# -- reading the server ------------------------------------------------------------------------


def scrape(url: str, timeout: float = 10) -> Scrape:
    """The server's /metrics now: empty when it serves none (an older server) or does not answer."""
    try:
        resp = requests.get(f"{url}/metrics", timeout=timeout)
        return Scrape.parse(resp.text) if resp.ok else Scrape()
    except (requests.RequestException, ValueError):
        return Scrape()


def server_info(url: str, timeout: float = 10) -> dict[str, Any]:
    """The server's /get_server_info now, or {} when it does not answer with a JSON object."""
    try:
        resp = requests.get(f"{url}/get_server_info", timeout=timeout)
        info = resp.json() if resp.ok else {}
    except (requests.RequestException, ValueError):
        return {}
    return info if isinstance(info, dict) else {}


# -- the figures -------------------------------------------------------------------------------


def number(value: Any) -> float | None:
    """value when it is a finite number (int stays int), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return value if math.isfinite(value) else None


def load_percentiles(before: Scrape, after: Scrape, name: str) -> dict[str, float | None]:
    """P50/P95/P99 (seconds) of what histogram `name` observed between two scrapes; None where
    it observed nothing or is not there."""
    return {k: number(v) for k, v in percentiles(delta_buckets(after.buckets(name), before.buckets(name))).items()}


def server_figures(before: Scrape, after: Scrape, info_after: dict[str, Any],
                   polled_used_pages: float | None) -> dict[str, Any]:
    """One load's `server` object in the JSON: latency percentiles (s) over the load, the largest
    polled used_pages, and PEAK_KEYS as get_server_info gave them after the load."""
    out: dict[str, Any] = {key: load_percentiles(before, after, name) for key, (_, name) in LATENCIES.items()}
    out["polled_peak_used_pages"] = number(polled_used_pages)
    out.update({key: number(info_after.get(key)) for key in PEAK_KEYS})
    return out


# -- printing ----------------------------------------------------------------------------------


def ms(p: dict[str, float | None]) -> str:
    """P50/P95/P99 in ms, each 6 wide, "-" for None."""
    return " ".join("     -" if v is None else f"{v * 1e3:6.0f}" for v in p.values())


def _count(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}"


def _mib(v: float | None) -> str:
    return "-" if v is None else f"{v / 2**20:.0f}"


def figures_table(client: dict[str, Any], server: dict[str, Any]) -> list[str]:
    """One load's client and server P50/P95/P99 (ms) side by side, row by row of LATENCIES, then
    its KV and memory peaks."""
    lines = [f"{'':>6s} | {'client ms p50/p95/p99':>20s} | {'server ms p50/p95/p99':>20s}"]
    for key, (label, _) in LATENCIES.items():
        lines.append(f"{label:>6s} | {ms(client.get(key, NO_FIGURES))} | {ms(server.get(key, NO_FIGURES))}")
    lines.append(f"peak KV pages: {_count(server.get('polled_peak_used_pages'))} used (polled),"
                 f" {_count(server.get('kv_peak_used_pages'))} (server's kv_peak_used_pages),"
                 f" of {_count(server.get('num_pages'))} in the pool")
    lines.append(f"peak memory MiB: worker RSS {_mib(server.get('worker_rss_peak_bytes'))},"
                 f" device {_mib(server.get('device_memory_peak_bytes'))},"
                 f" limit {_mib(server.get('memory_limit_bytes'))}")
    return lines

"""`radixrt top URL`: a running server's figures in a terminal, for an operator without Grafana.

Every --interval seconds (default 1) it reads URL/metrics and URL/get_server_info and prints one frame:
latency and request-length percentiles since start and over the last interval, load and throughput,
the KV pool, the memory watermark, churn, failures and the quality spot checks (docs/metrics.md names
each figure). A figure the server does not export (an older radixrt) shows as "-". --once prints one
frame, without the last-interval figures (they need two scrapes). Exit status 0, Ctrl-C included; 1,
with one line on stderr, when the server cannot be reached or does not answer 200.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from datetime import datetime
from typing import Any

import requests

from radixrt.launch_server import OneLineParser
from radixrt.ops.prom import Scrape, delta_buckets, percentiles

TIMEOUT_S = 5.0
CLEAR = "\x1b[H\x1b[2J"  # cursor home, then clear the screen: each frame overwrites the last on a terminal
DASH = "-"  # a figure the server does not report
# row label -> histogram; the rows of the two percentile tables
LATENCIES = {
    "TTFT": "sglang:time_to_first_token_seconds",
    "TPOT": "radixrt:time_per_output_token_seconds",
    "inter-token": "sglang:inter_token_latency_seconds",
    "E2E": "sglang:e2e_request_latency_seconds",
    "queueing": "sglang:queue_time_seconds",
}
LENGTHS = {"prompt": "sglang:prompt_tokens_histogram", "generation": "sglang:generation_tokens_histogram"}
TOP_CAUSES = 3  # refusal and error causes shown, most frequent first
LABEL_W, COL_W = 13, 9  # table widths: row label, each number column
UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
MEMORY = ("memory_limit_bytes", "worker_rss_bytes", "worker_rss_peak_bytes", "device_memory_allocated_bytes",
          "device_memory_reserved_bytes", "device_memory_peak_bytes", "host_tier_used_bytes",
          "host_tier_capacity_bytes", "disk_tier_used_bytes", "disk_tier_capacity_bytes")
QUALITY_COUNTERS = ("quality_spot_checks", "quality_spot_check_tokens", "quality_spot_checks_skipped")
QUALITY_GAUGES = ("quality_top1_agreement", "quality_mean_abs_dlogprob", "quality_last_top1_agreement",
                  "quality_last_mean_abs_dlogprob", "quality_spot_checks_pending")
# figure -> (get_server_info key, /metrics sample), as docs/metrics.md pairs them; Figures.get reads the first present
SOURCES: dict[str, tuple[str | None, str | None]] = {
    "running": ("running", "sglang:num_running_reqs"),
    "waiting": ("waiting", "sglang:num_queue_reqs"),
    "token_usage": (None, "sglang:token_usage"),
    "num_pages": ("num_pages", None),
    "free_pages": ("free_pages", None),
    "used_pages": ("used_pages", "radixrt:kv_used_pages"),
    "kv_peak_used_pages": ("kv_peak_used_pages", "radixrt:kv_peak_used_pages"),
    "cached_pages": ("cached_pages", None),
    "cache_hit_rate": ("cache_hit_rate", "sglang:cache_hit_rate"),
    "retractions": ("retractions", "radixrt:retractions_total"),
    "swaps_out": ("swaps_out", "radixrt:swaps_out_total"),
    "swaps_in": ("swaps_in", "radixrt:swaps_in_total"),
    "evicted_pages": ("evicted_pages", "radixrt:evicted_pages_total"),
    "aborted": (None, "sglang:num_aborted_requests_total"),
    "aborted_by_cause": (None, "radixrt:aborted_requests_total"),
    "refused": (None, "radixrt:refused_requests_total"),
    "retractions_by_cause": (None, "radixrt:retractions_by_cause_total"),
    "internal_errors": (None, "radixrt:internal_errors_total"),
    "refused_no_memory": ("requests_refused_no_memory", "radixrt:requests_refused_no_memory_total"),
    **{k: (k, f"radixrt:{k}") for k in MEMORY + QUALITY_GAUGES},
    **{k: (k, f"radixrt:{k}_total") for k in QUALITY_COUNTERS},
}


class Figures:
    """One frame's inputs. get(figure) reads its get_server_info key, else its /metrics sample
    (summed over labels), else None. A metric the scrape declares without samples (a labelled
    counter nobody has incremented) reads 0."""

    def __init__(self, scrape: Scrape, info: dict[str, Any]) -> None:
        self.scrape, self.info = scrape, info
        self.declared = scrape.sample_names()

    def get(self, figure: str) -> float | None:
        key, metric = SOURCES[figure]
        value = self.info.get(key) if key else None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if metric is None or metric not in self.declared:
            return None
        return self.scrape.value(metric, default=0.0)

    def by_label(self, figure: str, label: str) -> dict[str, float]:
        """A figure's /metrics samples summed per value of label, largest first."""
        _, metric = SOURCES[figure]
        out: dict[str, float] = {}
        for (name, labels), value in self.scrape.samples.items():
            if name == metric and label in dict(labels):
                out[dict(labels)[label]] = out.get(dict(labels)[label], 0.0) + value
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def missing(v: float | None) -> bool:
    return v is None or math.isnan(v)


def num(v: float | None, fmt: str = ",.0f") -> str:
    return DASH if missing(v) else format(v, fmt)


def pct(v: float | None) -> str:
    return DASH if missing(v) else f"{v:.1%}"


def size(v: float | None) -> str:
    """Bytes in binary units: 1.5 GiB."""
    if missing(v):
        return DASH
    exp = max((e for e in range(len(UNITS)) if v >= 1024**e), default=0)
    return f"{v:.0f} B" if exp == 0 else f"{v / 1024 ** exp:.1f} {UNITS[exp]}"


def of_limit(v: float | None, limit: float | None) -> str:
    """Bytes and, with a known limit, their share of it: 1.5 GiB (18.8%)."""
    share = f" ({v / limit:.1%})" if not missing(v) and not missing(limit) and limit > 0 else ""
    return size(v) + share


def causes(counts: dict[str, float], most: int | None = None) -> str:
    shown = list(counts.items())[:most]
    return f" ({', '.join(f'{k} {num(v)}' for k, v in shown)})" if shown else ""


def rate(scrape: Scrape, previous: Scrape | None, interval: float | None, metric: str) -> float | None:
    """A counter's increase per second between two scrapes (None without both, or after a reset)."""
    if previous is None or not interval:
        return None
    after, before = scrape.value(metric, default=math.nan), previous.value(metric, default=math.nan)
    return (after - before) / interval if after >= before else None  # NaN compares False: None


def cells(buckets: list[tuple[float, float]], scale: float, fmt: str) -> str:
    """count, p50, p95, p99 of cumulative buckets (no buckets: "-"; no observations: 0 and "-")."""
    count = buckets[-1][1] if buckets else None
    qs = percentiles(buckets).values()
    return "".join(f"{s:>{COL_W}}" for s in (num(count), *(num(q * scale, fmt) for q in qs)))


def histogram_table(title: str, rows: dict[str, str], scale: float, fmt: str, scrape: Scrape,
                    previous: Scrape | None, interval: float | None) -> list[str]:
    """One row of percentiles per histogram: since start, and with a previous scrape, since then."""
    cols = "".join(f"{c:>{COL_W}}" for c in ("count", "p50", "p95", "p99"))
    live = previous is not None
    since = f"{title}, since start"
    lines = [f"{since:<{LABEL_W + 2 + 4 * COL_W}} | last {num(interval, '.1f')} s" if live else since,
             " " * (LABEL_W + 2) + cols + (f" | {cols}" if live else "")]
    for label, metric in rows.items():
        now = scrape.buckets(metric)
        line = f"  {label:<{LABEL_W}}{cells(now, scale, fmt)}"
        if live:
            line += f" | {cells(delta_buckets(now, previous.buckets(metric)) if now else [], scale, fmt)}"
        lines.append(line)
    return lines


def section(title: str, *lines: str) -> list[str]:
    return [title, *(f"  {line}" for line in lines)]


def header(info: dict[str, Any], url: str, at: datetime | None) -> list[str]:
    model = info.get("served_model_name") or info.get("model_path") or DASH
    when = at.strftime("%Y-%m-%d %H:%M:%S") if at is not None else DASH
    return [f"radixrt top   server {url}   model {model}   at {when}"]


def load(f: Figures, previous: Scrape | None, interval: float | None) -> list[str]:
    prompt = rate(f.scrape, previous, interval, "sglang:prompt_tokens_total")
    generation = rate(f.scrape, previous, interval, "sglang:generation_tokens_total")
    return section(
        "load",
        f"running {num(f.get('running'))}   queued {num(f.get('waiting'))}   "
        f"throughput: prompt {num(prompt, ',.1f')} tok/s, generation {num(generation, ',.1f')} tok/s",
    )


def kv_cache(f: Figures) -> list[str]:
    usage, pool, free = f.get("token_usage"), f.get("num_pages"), f.get("free_pages")
    if missing(usage) and pool and not missing(free):  # an older server: the same fraction from its pages
        usage = 1 - free / pool
    return section(
        "KV cache",
        f"token usage {pct(usage)}   used pages {num(f.get('used_pages'))} / {num(pool)}   "
        f"peak used {num(f.get('kv_peak_used_pages'))}   cached pages {num(f.get('cached_pages'))}   "
        f"hit rate {pct(f.get('cache_hit_rate'))}",
    )


def memory(f: Figures) -> list[str]:
    """The limit is the device's memory when there is one (its figures are 0 on CPU), else the host's:
    the share of it is shown for the device's figures, or else for the worker's RSS."""
    limit = f.get("memory_limit_bytes")
    on_device = any((f.get(f"device_memory_{k}_bytes") or 0) > 0 for k in ("allocated", "reserved", "peak"))
    rss_limit = None if on_device else limit

    def share(figure: str, of: float | None) -> str:
        return of_limit(f.get(figure), of)

    def tier(name: str) -> str:
        return f"{name} tier {size(f.get(f'{name}_tier_used_bytes'))} / {size(f.get(f'{name}_tier_capacity_bytes'))}"

    lines = [f"worker RSS {share('worker_rss_bytes', rss_limit)}, peak {share('worker_rss_peak_bytes', rss_limit)}"]
    if on_device:
        lines.append(f"device allocated {share('device_memory_allocated_bytes', limit)}, "
                     f"reserved {share('device_memory_reserved_bytes', limit)}, "
                     f"peak {share('device_memory_peak_bytes', limit)}")
    lines.append(f"{tier('host')}   {tier('disk')}")
    return section(f"memory (limit {size(limit)})", *lines)


def churn(f: Figures) -> list[str]:
    by_cause = f.by_label("retractions_by_cause", "cause")
    return section(
        "churn",
        f"retractions {num(f.get('retractions'))}{causes(by_cause)}   "
        f"swaps out {num(f.get('swaps_out'))}, in {num(f.get('swaps_in'))}   "
        f"evicted pages {num(f.get('evicted_pages'))}",
    )


def failures(f: Figures) -> list[str]:
    aborted, refused, errors = (causes(f.by_label(figure, "cause"), TOP_CAUSES)
                                for figure in ("aborted_by_cause", "refused", "internal_errors"))
    return section(
        "failures",
        f"aborted {num(f.get('aborted'))}{aborted}   refused (4xx) {num(f.get('refused'))}{refused}   "
        f"internal errors (5xx) {num(f.get('internal_errors'))}{errors}   "
        f"refused for lack of memory {num(f.get('refused_no_memory'))}",
    )


def quality(f: Figures) -> list[str]:
    checks = f.get("quality_spot_checks")
    if f.info.get("quality_spot_check_rate") == 0 and not checks:
        return section("quality spot checks", "off")

    def dlogprob(figure: str) -> str:
        return num(f.get(figure), ".4f")

    return section(
        "quality spot checks",
        f"checks {num(checks)}   tokens {num(f.get('quality_spot_check_tokens'))}   "
        f"top-1 agreement {pct(f.get('quality_top1_agreement'))}   "
        f"mean |dlogprob| {dlogprob('quality_mean_abs_dlogprob')}",
        f"last check: agreement {pct(f.get('quality_last_top1_agreement'))}, "
        f"mean |dlogprob| {dlogprob('quality_last_mean_abs_dlogprob')}   "
        f"pending {num(f.get('quality_spot_checks_pending'))}   skipped {num(f.get('quality_spot_checks_skipped'))}",
    )


def render(scrape: Scrape, info: dict[str, Any], previous: Scrape | None = None, interval: float | None = None,
           *, url: str = DASH, at: datetime | None = None) -> str:
    """One frame: scrape and info read now; previous, the scrape interval seconds before (the
    last-interval percentiles and the throughput); url and at, for the header."""
    f = Figures(scrape, info)
    return "\n".join([
        *header(info, url, at),
        *histogram_table("latency (ms)", LATENCIES, 1000.0, ",.1f", scrape, previous, interval),
        *histogram_table("request lengths (tokens)", LENGTHS, 1.0, ",.0f", scrape, previous, interval),
        *load(f, previous, interval), *kv_cache(f), *memory(f), *churn(f), *failures(f), *quality(f),
    ])


def _get(url: str, headers: dict[str, str], timeout: float) -> requests.Response:
    resp = requests.get(url, headers=headers, timeout=timeout)
    if resp.status_code != 200:
        raise requests.HTTPError(f"{resp.url} answered {resp.status_code}: {resp.text[:200]}")
    return resp


def fetch(url: str, api_key: str | None, timeout: float = TIMEOUT_S) -> tuple[Scrape, dict[str, Any]]:
    """/metrics (open) and /get_server_info (behind the api key). Raises requests.RequestException
    (unreachable, or a non-200 answer) or ValueError (a body that does not parse)."""
    base = url.rstrip("/")
    metrics = _get(f"{base}/metrics", {}, timeout)
    info = _get(f"{base}/get_server_info", {"Authorization": f"Bearer {api_key}"} if api_key else {}, timeout)
    return Scrape.parse(metrics.text), info.json()


def watch(url: str, interval: float, api_key: str | None, once: bool) -> int:
    """Print a frame every interval seconds (one with once), each over the last on a terminal, until
    Ctrl-C. The interrupt also sets a flag the loop checks: a KeyboardInterrupt raised inside a
    library's request code can be swallowed there, and top would then run on."""
    previous: Scrape | None = None
    last = 0.0
    clear = CLEAR if sys.stdout.isatty() else ""
    stopping = threading.Event()

    def interrupted(signum: int, frame: Any) -> None:
        stopping.set()
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, interrupted)
    while not stopping.is_set():
        scrape, info = fetch(url, api_key)
        now = time.monotonic()
        since = now - last if previous is not None else None
        frame = render(scrape, info, previous, since, url=url, at=datetime.now())
        if once:
            print(frame)
            return 0
        print(clear + frame + ("" if clear else "\n"), flush=True)
        previous, last = scrape, now
        stopping.wait(max(0.0, interval - (time.monotonic() - now)))
    return 0


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="radixrt top", description="A running server's figures in a terminal.")
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between frames")
    parser.add_argument("--once", action="store_true", help="print one frame and exit")
    parser.add_argument("--api-key", default=None,
                        help="the server's api key, for get_server_info (sent as 'Authorization: Bearer KEY')")
    ns = parser.parse_args(argv)
    if not ns.interval > 0:
        parser.error(f"--interval must be > 0, got {ns.interval}")
    try:
        return watch(ns.url, ns.interval, ns.api_key, ns.once)
    except (requests.RequestException, ValueError) as e:  # ValueError: a body that does not parse
        why = f"cannot reach {ns.url}: {e}" if isinstance(e, requests.ConnectionError) else str(e)
        print(f"radixrt top: {' '.join(why.split())}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0

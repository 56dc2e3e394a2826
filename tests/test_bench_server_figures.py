"""bench/server_figures.py without a server: the `server` object and table of one load, built
from two synthetic /metrics scrapes, and the KV poller stopping with its block."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from radixrt.ops.prom import Scrape

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from common import Poller  # noqa: E402
from server_figures import LATENCIES, figures_table, scrape, server_figures  # noqa: E402

BUCKETS = (0.01, 0.1, 1, 10)
INFO = {"kv_peak_used_pages": 40, "num_pages": 64, "worker_rss_peak_bytes": 300 * 2**20,
        "device_memory_peak_bytes": 0, "memory_limit_bytes": 8 * 2**30, "used_pages": 3}


def registry_with(names: list[str]) -> tuple[CollectorRegistry, dict[str, Histogram]]:
    reg = CollectorRegistry()
    return reg, {n: Histogram(n, n, ["model_name"], buckets=BUCKETS, registry=reg) for n in names}


def two_scrapes(names: list[str]) -> tuple[Scrape, Scrape]:
    """Before: 10 slow observations (5 s) of each histogram, from earlier loads; during the load:
    100 more, between 50 and 60 ms, so every percentile of the load lies in the (10, 100] ms bucket."""
    reg, hists = registry_with(names)
    for h in hists.values():
        for _ in range(10):
            h.labels(model_name="m").observe(5.0)
    before = Scrape.parse(generate_latest(reg).decode())
    for h in hists.values():
        for i in range(100):
            h.labels(model_name="m").observe(0.05 + i * 1e-4)
    return before, Scrape.parse(generate_latest(reg).decode())


def test_percentiles_come_from_the_load_alone():
    before, after = two_scrapes([name for _, name in LATENCIES.values()])
    server = server_figures(before, after, INFO, 37)
    for key in LATENCIES:
        p = server[key]
        assert 0.01 < p["p50"] < p["p95"] < p["p99"] <= 0.1, (key, p)  # the 5 s ones came before the load
        assert abs(p["p50"] - 0.055) < 0.01  # interpolated inside (10, 100] ms: half way
    assert server["polled_peak_used_pages"] == 37
    assert {k: server[k] for k in INFO if k != "used_pages"} == {k: v for k, v in INFO.items() if k != "used_pages"}


def test_an_older_server_gives_none_and_dashes():
    """Only TTFT, under SGLang's name; no TPOT, queue or E2E histogram and no peak keys."""
    before, after = two_scrapes(["sglang:time_to_first_token_seconds"])
    server = server_figures(before, after, {"num_pages": 64}, None)
    assert server["ttft_s"]["p50"] is not None
    for key in ("tpot_s", "queue_s", "e2e_s"):
        assert server[key] == {"p50": None, "p95": None, "p99": None}
    assert server["polled_peak_used_pages"] is None and server["kv_peak_used_pages"] is None
    assert server["num_pages"] == 64

    client = {"ttft_s": {"p50": 0.052, "p95": 0.06, "p99": 0.07}, "tpot_s": {"p50": None, "p95": None, "p99": None},
              "e2e_s": {"p50": 1.0, "p95": 2.0, "p99": 3.0}}
    table = figures_table(client, server)
    rows = {line.split("|")[0].strip(): line for line in table[1:5]}
    assert list(rows) == ["TTFT", "TPOT", "queue", "E2E"]
    assert rows["TTFT"].split("|")[1].split() == ["52", "60", "70"]
    assert rows["queue"].split("|")[1].split() == ["-", "-", "-"]  # the client has no queueing
    assert rows["E2E"].split("|")[2].split() == ["-", "-", "-"]
    assert table[5] == "peak KV pages: - used (polled), - (server's kv_peak_used_pages), of 64 in the pool"
    assert table[6] == "peak memory MiB: worker RSS -, device -, limit -"


def test_a_server_without_metrics_scrapes_empty():
    empty = scrape("http://127.0.0.1:1", timeout=1)  # nothing listens on port 1
    assert empty.samples == {} and server_figures(empty, empty, {}, None)["e2e_s"]["p99"] is None


def test_poller_keeps_the_largest_and_stops_with_its_block():
    seen = iter([{"used_pages": 5}, {}, {"used_pages": 12}, {"used_pages": "x"}, {"used_pages": 7}])
    calls = []

    def read():
        calls.append(time.monotonic())
        return next(seen, {"used_pages": 3})

    with Poller(read, "used_pages", 0.1, limit_s=30) as poller:
        time.sleep(0.65)
    n = len(calls)
    assert 2 <= n <= 8  # about every 100 ms (fewer on a busy machine, never a tight loop)
    assert poller.peak == 12
    time.sleep(0.25)
    assert len(calls) == n  # stopped with the block


def test_poller_stops_at_its_limit():
    calls = []
    with Poller(lambda: calls.append(1) or {}, "used_pages", 0.1, limit_s=0.25) as poller:
        poller._thread.join(timeout=10)  # it ends by itself, before the block does
        assert not poller._thread.is_alive()
    assert 1 <= len(calls) <= 4 and poller.peak is None

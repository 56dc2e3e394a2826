"""`radixrt top` (radixrt/ops/top.py): render() over a scrape of the contract's metrics (docs/metrics.md)
with known observations, and over nothing; the command against a stub server (the api key, a refusal),
a server that is not there, and the real one."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from radixrt.ops.prom import Scrape
from radixrt.ops.top import main as top_main
from radixrt.ops.top import render

ROOT = Path(__file__).resolve().parents[1]
HEADINGS = ("latency (ms), since start", "request lengths (tokens), since start", "load", "KV cache",
            "memory (limit ", "churn", "failures", "quality spot checks")
GIB = 1024**3
INFO = {
    "served_model_name": "tiny", "model_path": "/models/tiny", "running": 2, "waiting": 3,
    "num_pages": 100, "free_pages": 65, "used_pages": 25, "cached_pages": 10, "kv_peak_used_pages": 40,
    "cache_hit_rate": 0.5, "retractions": 2, "swaps_out": 1, "swaps_in": 1, "evicted_pages": 7,
    "memory_limit_bytes": 8 * GIB, "worker_rss_bytes": GIB, "worker_rss_peak_bytes": 2 * GIB,
    "device_memory_allocated_bytes": 0, "device_memory_reserved_bytes": 0, "device_memory_peak_bytes": 0,
    "quality_spot_check_rate": 0.0, "quality_spot_checks": 0,
}


class ContractMetrics:
    """A few of the contract's metrics, under its names, types and labels."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram("sglang:time_to_first_token_seconds", "ttft", ["model_name"], buckets=(0.01, 0.1, 1.0),
                              registry=r).labels("tiny")
        self.prompt = Histogram("sglang:prompt_tokens_histogram", "prompt lengths", ["model_name"],
                                buckets=(8, 64, 512), registry=r).labels("tiny")
        self.generated = Counter("sglang:generation_tokens", "generated tokens", ["model_name"],
                                 registry=r).labels("tiny")
        self.refused = Counter("radixrt:refused_requests", "4xx", ["status", "cause"], registry=r)
        Counter("radixrt:internal_errors", "5xx", ["status", "cause"], registry=r)  # declared, never incremented
        self.retractions = Counter("radixrt:retractions_by_cause", "retractions", ["cause"], registry=r)

    def scrape(self) -> Scrape:
        return Scrape.parse(generate_latest(self.registry).decode())


def row(frame: str, label: str) -> list[str]:
    """The cells of the table row named label."""
    return next(line.split() for line in frame.splitlines() if line.split()[:1] == [label])


def has_headings(frame: str) -> bool:
    """Every section heading starts a line (a section's figures are indented under it)."""
    return all(any(line.startswith(h) for line in frame.splitlines()) for h in HEADINGS)


def test_render_prints_the_percentiles_and_figures():
    m = ContractMetrics()
    for _ in range(50):
        m.ttft.observe(0.005)
        m.ttft.observe(0.05)
    for _ in range(10):
        m.prompt.observe(4)
        m.prompt.observe(100)
    m.generated.inc(30)
    m.refused.labels("400", "max_new_tokens").inc(3)
    m.refused.labels("401", "auth").inc()
    m.retractions.labels("decode_growth").inc(2)
    first = m.scrape()
    frame = render(first, INFO, url="http://h:1", at=datetime(2025, 1, 2, 3, 4, 5))
    assert frame.splitlines()[0] == "radixrt top   server http://h:1   model tiny   at 2025-01-02 03:04:05"
    # 50 at 5 ms and 50 at 50 ms in buckets 10, 100, 1000 ms: p95 = 10 + 90 * 45/50 ms (interpolated, as Prometheus)
    assert row(frame, "TTFT") == ["TTFT", "100", "10.0", "91.0", "98.2"]
    assert row(frame, "TPOT") == ["TPOT", "-", "-", "-", "-"]
    assert row(frame, "prompt") == ["prompt", "20", "8", "467", "503"]  # p95 = 64 + 448 * 9/10
    assert "running 2   queued 3   throughput: prompt - tok/s, generation - tok/s" in frame
    assert "token usage 35.0%   used pages 25 / 100   peak used 40   cached pages 10   hit rate 50.0%" in frame
    assert "memory (limit 8.0 GiB)\n  worker RSS 1.0 GiB (12.5%), peak 2.0 GiB (25.0%)\n" in frame
    assert "device" not in frame  # 0 on CPU
    assert "retractions 2 (decode_growth 2)   swaps out 1, in 1   evicted pages 7" in frame
    assert ("aborted -   refused (4xx) 4 (max_new_tokens 3, auth 1)   internal errors (5xx) 0   "
            "refused for lack of memory -") in frame
    assert frame.endswith("quality spot checks\n  off")

    for _ in range(10):
        m.ttft.observe(0.5)
    m.generated.inc(100)
    live = render(m.scrape(), INFO, previous=first, interval=2.0)
    assert "| last 2.0 s" in live
    assert row(live, "TTFT") == ["TTFT", "110", "19.0", "505.0", "901.0", "|", "10", "550.0", "955.0", "991.0"]
    assert row(live, "prompt") == ["prompt", "20", "8", "467", "503", "|", "0", "-", "-", "-"]
    assert "throughput: prompt - tok/s, generation 50.0 tok/s" in live


def test_render_shows_device_memory_and_quality_when_there_are_some():
    info = {**INFO, "device_memory_allocated_bytes": 2 * GIB, "device_memory_reserved_bytes": 4 * GIB,
            "device_memory_peak_bytes": 3 * GIB, "quality_spot_check_rate": 0.5, "quality_spot_checks": 3,
            "quality_spot_check_tokens": 40, "quality_top1_agreement": 0.975, "quality_mean_abs_dlogprob": 0.0123,
            "quality_last_top1_agreement": 1.0, "quality_last_mean_abs_dlogprob": 0.004,
            "quality_spot_checks_pending": 1, "quality_spot_checks_skipped": 0}
    frame = render(Scrape(), info)
    assert "device allocated 2.0 GiB (25.0%), reserved 4.0 GiB (50.0%), peak 3.0 GiB (37.5%)" in frame
    assert "worker RSS 1.0 GiB, peak 2.0 GiB" in frame  # the limit is the device's: no share of it
    assert "checks 3   tokens 40   top-1 agreement 97.5%   mean |dlogprob| 0.0123" in frame
    assert "last check: agreement 100.0%, mean |dlogprob| 0.0040   pending 1   skipped 0" in frame


def test_render_of_nothing_is_dashes():
    for frame in (render(Scrape(), {}), render(Scrape(), {}, previous=Scrape(), interval=1.0)):
        assert has_headings(frame)
        assert row(frame, "TTFT")[1:5] == ["-"] * 4 and row(frame, "generation")[1:5] == ["-"] * 4
        assert "model -" in frame and "used pages - / -" in frame and "refused (4xx) -" in frame
        assert "checks -" in frame  # not "off": a server that does not say its rate may be checking


# -- the command ----------------------------------------------------------------------------------


@pytest.fixture
def stub() -> Iterator[str]:
    """A server answering the contract's metrics, and get_server_info only to 'Bearer k'."""
    metrics = generate_latest(ContractMetrics().registry)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            ok = self.path == "/metrics" or self.headers.get("Authorization") == "Bearer k"
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(metrics if self.path == "/metrics" else json.dumps(INFO if ok else {"error": 1}).encode())

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_command_sends_the_api_key_and_fails_in_one_line(stub, capsys):
    assert top_main([stub, "--once", "--api-key", "k"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(f"radixrt top   server {stub}   model tiny") and out.err == ""
    assert top_main([stub, "--once"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "401" in out.err


def top(*args: str, **kw: Any) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "radixrt.cli", "top", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, **kw)


def test_an_unreachable_server_is_one_line_and_status_1():
    out = top("http://127.0.0.1:1", "--once")
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("radixrt top: cannot reach http://127.0.0.1:1")


def test_top_reads_a_real_server(server, llama_path):
    r = requests.post(f"{server}/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 4}},
                      timeout=60)
    assert r.status_code == 200
    out = top(server, "--once")
    assert out.returncode == 0, out.stderr
    frame = out.stdout
    assert frame.startswith(f"radixrt top   server {server}   model {llama_path}   at ")
    assert has_headings(frame)
    assert re.search(r"running \d+   queued \d+", frame) and re.search(r"used pages \d+ / \d+", frame)
    # the contract's TTFT: at least our request, in milliseconds
    count, p50 = (float(c.replace(",", "")) for c in row(frame, "TTFT")[1:3])
    assert count >= 1 and p50 > 0


def test_live_frames_and_ctrl_c(server):
    """Two frames (the second with the last interval's figures), then SIGINT: status 0, nothing on stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "radixrt.cli", "top", server, "--interval", "0.2"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "| last " in line:
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and err == ""

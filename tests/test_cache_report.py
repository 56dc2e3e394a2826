"""The prefix-cache diagnosis (radixrt/frontend/cache_report.py): synthetic workloads fed with the
cached_tokens a radix cache gives (the longest common prefix with an earlier text, prompt + output),
one check through a real Engine, the /metrics section, and `radixrt cache-report` against a stub
server and the real one."""

from __future__ import annotations

import json
import logging
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from random import Random
from typing import Any, Iterator

import pytest
import requests

from radixrt.frontend.cache_report import CacheDiagnosis
from radixrt.launch.ports import free_port
from radixrt.messages import FinishReason, ReqOutput
from radixrt.ops.cache_report import main as cache_report_main
from support.scheduling import make

GREEDY = {"max_new_tokens": 4, "temperature": 0}


def tokens(rng: Random, n: int) -> list[int]:
    return [rng.randrange(3, 1000) for _ in range(n)]


class NaiveCache:
    """What the radix tree returns at admission: the longest common prefix of the prompt with any
    earlier text (prompt + output), at most all but the prompt's last token."""

    def __init__(self) -> None:
        self.texts: list[list[int]] = []

    def run(self, diag: CacheDiagnosis, prompt: list[int], output: list[int]) -> int:
        cached = min(max((len(os.path.commonprefix([prompt, t])) for t in self.texts), default=0), len(prompt) - 1)
        diag.observe(prompt, cached, output)
        self.texts.append(prompt + output)
        return cached


def kinds(report: dict[str, Any]) -> list[str]:
    return [c["kind"] for c in report["causes"]]


def variable_start(diag: CacheDiagnosis, n: int, prefix_len: Any = 8, seed: int = 0) -> None:
    """n prompts: a varying prefix (a timestamp), then shared content, then a short unique tail."""
    rng, cache = Random(seed), NaiveCache()
    shared = tokens(rng, 200)
    for _ in range(n):
        length = prefix_len(rng) if callable(prefix_len) else prefix_len
        cache.run(diag, tokens(rng, length) + shared + tokens(rng, 8), tokens(rng, 4))


def shared_prefix(diag: CacheDiagnosis, n: int, system_len: int = 200, seed: int = 1) -> None:
    """n prompts: one system prompt, then different questions."""
    rng, cache = Random(seed), NaiveCache()
    system = tokens(rng, system_len)
    for _ in range(n):
        cache.run(diag, system + tokens(rng, 40), tokens(rng, 8))


def conversations(diag: CacheDiagnosis, keep_chunks: int | None, summary: bool = False, seed: int = 2) -> None:
    """4 interleaved conversations of 8 turns under one system prompt. keep_chunks=None: each prompt
    extends the previous prompt + answer; else it keeps the start (system + first user turn) and the
    last keep_chunks messages of the history (behind a fresh summary, with summary=True)."""
    rng, cache = Random(seed), NaiveCache()
    system = tokens(rng, 32)
    starts = [system + tokens(rng, 16) for _ in range(4)]
    history: list[list[list[int]]] = [[] for _ in starts]  # per conversation: its messages after the start
    for _turn in range(8):
        for c, start in enumerate(starts):
            user, kept = tokens(rng, 24), history[c]
            if keep_chunks is not None and len(kept) > keep_chunks:
                kept = ([tokens(rng, 16)] if summary else []) + kept[-keep_chunks:]
            prompt = start + [t for msg in kept for t in msg] + user
            answer = tokens(rng, 8)
            cache.run(diag, prompt, answer)
            history[c] += [user, answer]


@pytest.mark.parametrize("prefix_len", [8, lambda rng: rng.randrange(3, 14)], ids=["fixed", "varying-length"])
def test_a_variable_start_is_diagnosed(prefix_len):
    diag = CacheDiagnosis()
    variable_start(diag, 32, prefix_len)
    rep = diag.report()
    assert rep["prompts"] == 32 and rep["hit_rate"] < 0.05
    assert kinds(rep) == ["variable_start"], rep["causes"]
    cause = rep["causes"][0]
    assert cause["share"] >= 0.9 and "within their first 16 tokens" in cause["message"]
    assert "move it to the end" in cause["message"]
    assert rep["early_divergence_share"] >= 0.9 and rep["shared_token_rate"] > 0.8
    assert rep["divergence"]["buckets"]["0"] + rep["divergence"]["buckets"]["1-16"] == 32


@pytest.mark.parametrize("system_len", [200, 10])
def test_shared_prefix_prompts_are_neither_variable_start_nor_truncation(system_len):
    diag = CacheDiagnosis()
    shared_prefix(diag, 32, system_len)
    rep = diag.report()
    assert rep["cause_shares"]["variable_start"] == 0 and rep["cause_shares"]["truncation"] == 0
    assert rep["cause_shares"]["evicted"] == 0
    # all but the first share the system prompt; 10 tokens are less than a window: too short to tell
    assert rep["shared_prefix"]["prompts"] == (31 if system_len == 200 else 0)
    if system_len == 200:
        assert rep["causes"] == [] and rep["hit_rate"] > 0.75
        assert rep["divergence"]["percentiles"]["p50"] == 200 and rep["divergence"]["buckets"]["65-256"] == 31
    else:  # 10 shared tokens of 50: too little repetition to gain much
        assert kinds(rep) == ["low_repetition"]


@pytest.mark.parametrize("summary", [False, True], ids=["truncated", "summarized"])
def test_a_truncated_history_is_diagnosed(summary):
    diag = CacheDiagnosis()
    conversations(diag, keep_chunks=4, summary=summary)
    rep = diag.report()
    # turns 3..7 of each conversation (5 of 8) kept the start and the last 2 turns, not the middle
    assert rep["cause_shares"]["truncation"] == pytest.approx(5 / 8)
    assert kinds(rep)[0] == "truncation" and rep["cause_shares"]["variable_start"] == 0
    assert "median of 48 tokens" in rep["causes"][0]["message"]


def test_an_append_only_conversation_is_not_truncation():
    diag = CacheDiagnosis()
    conversations(diag, keep_chunks=None)
    rep = diag.report()
    assert rep["causes"] == [] and rep["hit_rate"] > 0.6
    assert rep["cause_shares"]["truncation"] == 0 and rep["cause_shares"]["variable_start"] == 0


def test_unrelated_prompts_are_low_repetition_and_a_disabled_cache_says_so():
    rng, diag = Random(3), CacheDiagnosis()
    for _ in range(20):
        diag.observe(tokens(rng, 100), 0, tokens(rng, 4))
    rep = diag.report()
    assert kinds(rep) == ["low_repetition"] and rep["causes"][0]["share"] == 1.0

    off = CacheDiagnosis(cache_enabled=False)
    rng = Random(1)
    system = tokens(rng, 200)
    for _ in range(20):
        off.observe(system + tokens(rng, 40), 0, tokens(rng, 8))  # the cache serves nothing
    rep = off.report()
    assert kinds(rep) == ["cache_disabled"] and rep["cause_shares"]["evicted"] == 0
    assert "--disable-radix-cache" in rep["causes"][0]["message"] and rep["shared_token_rate"] > 0.7


def test_a_prefix_the_cache_lost_is_evicted():
    rng, diag = Random(4), CacheDiagnosis()
    system = tokens(rng, 128)
    for _ in range(16):
        diag.observe(system + tokens(rng, 32), 0, tokens(rng, 4))  # as if each were evicted at once
    assert kinds(diag.report()) == ["evicted"]


def test_histogram_percentiles_and_first_n():
    rng, diag = Random(5), CacheDiagnosis()
    for cached in (0, 5, 16, 17, 64, 100, 300, 1999, 1500, 0):
        diag.observe(tokens(rng, 2000), cached, [])
    rep = diag.report(first_n=17)
    assert rep["divergence"]["buckets"] == {"0": 2, "1-16": 2, "17-64": 2, "65-256": 1, "257-1024": 1, ">1024": 2}
    assert rep["divergence"]["percentiles"] == {"p10": 0, "p50": 17, "p90": 1500, "p99": 2000}
    assert rep["divergence"]["fully_matched_share"] == 0.1  # 1999 of 2000: all but the last token
    assert rep["early_divergence_share"] == 0.4 and rep["first_n"] == 17
    assert rep["hit_rate"] == pytest.approx((5 + 16 + 17 + 64 + 100 + 300 + 1999 + 1500) / 20000, abs=1e-4)
    json.dumps(rep)


def test_memory_is_bounded_and_reports_run_beside_observe():
    rng, diag = Random(6), CacheDiagnosis(capacity=8)
    done, errors = threading.Event(), []

    def reader() -> None:
        while not done.is_set():
            try:
                diag.report()
            except Exception as e:  # noqa: BLE001
                errors.append(e)

    thread = threading.Thread(target=reader)
    thread.start()
    for _ in range(100):
        diag.observe(tokens(rng, 160), 0, tokens(rng, 16))
    done.set()
    thread.join()
    assert not errors and diag.report()["prompts"] == 8
    assert len(diag._windows) <= 8 * 11 and len(diag._prefixes) <= 8 * 11  # 176 tokens: 11 windows each


def test_the_low_hit_rate_warning_is_rate_limited(caplog):
    now = [0.0]
    diag = CacheDiagnosis(warn_period_s=300, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="radixrt.frontend.cache_report"):
        variable_start(diag, 120)
        warnings = [r.getMessage() for r in caplog.records]
        assert len(warnings) == 1, warnings
        assert "hit rate is 0.0%" in warnings[0] and "variable content (timestamps, ids)" in warnings[0]
        now[0] = 301.0
        variable_start(diag, 1)  # the same workload again
        assert len(caplog.records) == 2
        caplog.clear()
        shared_prefix(CacheDiagnosis(warn_period_s=0), 64)  # a high hit rate: never
        assert not caplog.records


def test_metrics_show_the_diagnosis():
    from radixrt.frontend.req_state import ReqState
    from radixrt.server.metrics import ServerMetrics

    diag = CacheDiagnosis()
    variable_start(diag, 20)
    metrics = ServerMetrics(make(num_pages=8, page_size=4)[0].stats, diag.report)
    state = ReqState("r", list(range(100)), None, None, lambda: None)
    metrics.observe(state, ReqOutput("r", [], FinishReason("stop"), 100, 20))
    text = metrics.render().decode()
    assert "radixrt:cache_report_prompts 20.0" in text
    assert 'radixrt:cache_cause_share{kind="variable_start"} 0.95' in text
    assert "radixrt:cache_early_divergence_share 1.0" in text and "radixrt:cache_shared_prefix_hit_rate" in text
    assert 'radixrt:cache_divergence_tokens_bucket{le="16.0"} 0.0' in text
    assert 'radixrt:cache_divergence_tokens_bucket{le="64.0"} 1.0' in text


def test_an_engine_diagnoses_its_own_requests(llama_path):
    import radixrt

    rng = Random(7)
    shared = tokens(rng, 96)
    with radixrt.Engine(model_path=str(llama_path), max_total_tokens=4096, page_size=1, log_level="warning") as engine:
        results = [engine.generate(input_ids=tokens(rng, 8) + shared, sampling_params=GREEDY) for _ in range(12)]
        cached = [res["meta_info"]["cached_tokens"] for res in results]
        rep = engine.cache_report()
    assert rep["prompts"] == 12 and rep["cached_tokens"] == sum(cached) and rep["prompt_tokens"] == 12 * 104
    assert "variable_start" in kinds(rep)


# -- radixrt cache-report -------------------------------------------------------------------------


@pytest.fixture
def stub() -> Iterator[tuple[str, list[dict[str, str]]]]:
    """A server whose /cache_report answers a diagnosed report, wanting 'Bearer k' when a key is sent."""
    diag = CacheDiagnosis()
    variable_start(diag, 20)
    body, seen = json.dumps(diag.report()).encode(), []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(dict(self.headers))
            key = self.headers.get("Authorization")
            ok = self.path.startswith("/cache_report?first_n=") and key in (None, "Bearer k")
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(body if ok else b'{"error": {"message": "invalid or missing API key"}}')

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", seen
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_the_cli_prints_causes_first(stub, capsys):
    url, seen = stub
    assert cache_report_main([url, "--api-key", "k"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("causes:\n  - [variable_start] 95% of prompts diverge within their first 16 tokens")
    assert "recent prompts: 20" in out and "hit rate" in out and "1-16 tokens:" in out
    assert seen[-1]["Authorization"] == "Bearer k"
    assert cache_report_main([url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["prompts"] == 20


def test_the_cli_fails_in_one_line(stub, capsys):
    url, _ = stub
    assert cache_report_main([url, "--api-key", "wrong"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and "401" in out.err
    port = free_port()  # nothing listens there once it is picked
    assert cache_report_main([f"http://127.0.0.1:{port}"]) == 1
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1 and out.err.startswith("radixrt cache-report: ")


def test_the_cli_reads_a_real_server(server, capsys):
    r = requests.post(f"{server}/generate", json={"input_ids": tokens(Random(8), 40), "sampling_params": GREEDY},
                      timeout=60)
    assert r.status_code == 200
    assert requests.get(f"{server}/cache_report", params={"first_n": 0}, timeout=10).status_code == 400
    assert cache_report_main([server, "--first-n", "32"]) == 0
    out = capsys.readouterr().out
    assert "recent prompts:" in out and "within the first 32 tokens" in out
    assert "unreachable pages: 0 " in out and "pinned pages: 0 of a budget of " in out  # an admin's report: every namespace
    memory = requests.get(f"{server}/cache_report", timeout=10).json()["memory"]
    assert memory["unreachable_pages"] == 0 and memory["pin_budget_pages"] > 0
    assert "radixrt:cache_report_prompts" in requests.get(f"{server}/metrics", timeout=10).text

"""Production scheduling (issue 36): decode fairness, priorities, tenants' KV quotas, one run per model.

Each case runs on a fresh `radixrt launch_server` (127.0.0.1, page size 16, --context-length 4096,
greedy, ignore_eos), warmed by a few requests (one of them long, so the step-time model behind
--max-decode-slowdown has seen a big prefill) before anything is timed. Requests stream from the
native /generate; the client records when it sent each one, when each chunk that brought tokens
came, and the stream's end:

  TTFT  send -> first chunk with an output token
  TPOT  per request: (E2E - TTFT) / (output tokens - 1); P50/P99 over requests
  gap   the time between two consecutive token-bearing chunks (a stall a user sees); P99 over all

1. fairness   short requests (100-200 prompt tokens, 32-64 output tokens) from a closed loop of
              CONCURRENCY clients, alone ("short only"), then with every tenth request a long
              prompt (LONG tokens, 8 output tokens), each under the default --max-decode-slowdown
              1.5 and under 0 (the old behaviour: a long prompt prefilled whole in one step). The
              short requests are the same in all four; each case's ratios are to the short-only
              case with the same flag. Target: the short requests' TPOT P99 with long prompts
              within 2x of its value without them, at the default.
2. priority   --max-running-requests 4; LOW requests at priority 0 sent at once, then, once a queue
              has formed, HIGH requests at priority 100. TTFT and E2E of each class, without
              --enable-priority-scheduling (baseline; the field is sent and ignored), with it, and
              with it plus --max-queued-requests (how many of each class got the 503).
3. tenants    --max-total-tokens POOL. Tenant A (cache_salt "A") floods distinct POOL/16-token
              prompts from 4 clients; tenant B (cache_salt "B") sends one request over a shared
              POOL/8-token prefix after every B_EVERY completions of A's (enough of A's tokens to
              fill the pool, so LRU alone evicts B's prefix between two of B's requests). B's hit
              rate (meta_info cached_tokens / prompt_tokens, B's requests after its first) and B's
              latency, without a quota, with --tenant-kv-quota 0.5, and with an --api-keys-file
              giving A kv_quota 0.5 (clients send `Authorization: Bearer <key>`).
4. dp 2       not run here: bench/dp_router.py writes bench/results/dp_router.json.

Models: `tiny` and `small` are the peers' checkpoints (../shared/peers/setup.sh builds them under
$RADIXRT_PEERS or ~/.cache/radixrt-peers/models: bf16, vocab 8,192, 4,096-token context); without
them tiny falls back to scripts/make_tiny_model.py's llama-tiny and small to its llama-100m. A
checkpoint directory is accepted too. NOTE: the client shares the 2 cores with the server (and on
the dev box with other jobs): read the ratios within one run, not absolute figures.

Results merge per model into bench/results/scheduling.json (with the host's CPU and flags and the
sizes) and bench/results/scheduling.png.

    .venv/bin/python bench/scheduling.py [--models tiny,small] [--quick] [--items fairness,priority,tenants]

A full run took about 7 minutes on the quiet 2-core box (over 20 while other jobs ran: each case
records the load average after it, and a high one taints that case's ratios); --quick is shorter.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import requests
from common import RESULTS, ROOT, ClientTimes, ensure_model, write_result
from peaks import host

sys.path.insert(0, str(ROOT / "tests"))
from support.server_proc import stop

from radixrt.launch.ports import free_port

PAGE = 16
CONTEXT = 4096
DP_NOTE = "dp 2 figures live in bench/results/dp_router.json (bench/dp_router.py); not run here"


@dataclass(frozen=True)
class Sizes:
    fair_short: int  # short requests per fairness case
    concurrency: int  # closed-loop clients in the fairness cases
    long_tokens: int  # a long prompt's length (every tenth request in the mixed cases)
    prio_low: int
    prio_high: int
    prio_out: int  # output tokens of every priority request
    prio_queue_cap: int  # --max-queued-requests in the third priority case
    pool: int  # --max-total-tokens in the tenant cases
    b_requests: int  # tenant B's requests (the first is cold)
    b_every: int  # A's completions between two of B's requests


# Per (model, mode). small (88M, bf16) decodes ~10x slower than tiny on the 2-core box, so it gets fewer
# requests. b_every * pool/16 tokens of A's = the whole pool: LRU alone evicts B's prefix in between.
SIZES = {
    ("tiny", "full"): Sizes(fair_short=90, concurrency=8, long_tokens=3500, prio_low=40, prio_high=5, prio_out=24,
                            prio_queue_cap=20, pool=8192, b_requests=6, b_every=16),
    ("small", "full"): Sizes(fair_short=36, concurrency=8, long_tokens=3500, prio_low=24, prio_high=4, prio_out=12,
                             prio_queue_cap=12, pool=8192, b_requests=4, b_every=16),
    ("tiny", "quick"): Sizes(fair_short=27, concurrency=8, long_tokens=3500, prio_low=16, prio_high=3, prio_out=8,
                             prio_queue_cap=8, pool=8192, b_requests=3, b_every=16),
    ("small", "quick"): Sizes(fair_short=18, concurrency=8, long_tokens=3500, prio_low=12, prio_high=2, prio_out=8,
                              prio_queue_cap=6, pool=8192, b_requests=3, b_every=16),
}
REQUEST_CAP_S = 600  # a request still streaming after this long fails (a stalled server ends the run)


@dataclass(frozen=True)
class Req:
    kind: str  # the class a figure is reported under: short/long, low/high, A/B
    ids: list[int]
    max_new: int
    priority: int | None = None
    salt: str | None = None
    key: str | None = None  # API key sent as a bearer token

    def body(self) -> dict[str, Any]:
        body = {"input_ids": self.ids, "stream": True,
                "sampling_params": {"max_new_tokens": self.max_new, "temperature": 0, "ignore_eos": True}}
        extra = {"priority": self.priority, "cache_salt": self.salt}
        return body | {k: v for k, v in extra.items() if v is not None}


@dataclass
class Rec(ClientTimes):
    """One request as the client saw it (perf_counter seconds)."""

    kind: str
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk that brought tokens
    done: float | None = None
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    status: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.done is not None and bool(self.chunks) and self.error is None

    @property
    def rejected(self) -> bool:
        """Refused (the queue is full) or aborted for a more important request: a 503, as an HTTP
        status or as the code of an error chunk."""
        return self.status == 503 or "queue is full" in (self.error or "")

    @property
    def first(self) -> float:
        return self.chunks[0]

    @property
    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


# -- server and client --------------------------------------------------------------------------


@contextlib.contextmanager
def server(path: Path, *extra: str, timeout: float = 180) -> Iterator[str]:
    """A server on a free loopback port until the block ends; its output goes to a temporary file
    (a pipe nobody reads would block a chatty server) and is printed if it fails to start."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixrt.launch_server", "--model-path", str(path), "--host", "127.0.0.1",
           "--port", str(port), "--log-level", "warning", "--page-size", str(PAGE), "--context-length", str(CONTEXT), *extra]
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT / "tests", stdout=log, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + timeout
            while not healthy(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise RuntimeError(f"server did not start ({' '.join(extra)}):\n{log.read()[-3000:]}")
                time.sleep(0.2)
            yield url
        finally:
            stop(proc)


def healthy(url: str) -> bool:
    with contextlib.suppress(requests.RequestException):
        return requests.get(f"{url}/health", timeout=5).status_code == 200
    return False


def info(url: str, key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with contextlib.suppress(requests.RequestException, ValueError):
        resp = requests.get(f"{url}/get_server_info", headers=headers, timeout=10)
        return resp.json() if resp.status_code == 200 else {}
    return {}


def session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=REQUEST_CAP_S))


async def stream(s: aiohttp.ClientSession, url: str, req: Req) -> Rec:
    """Send req and read its SSE stream to [DONE]; an HTTP error or an error chunk ends the record."""
    rec = Rec(req.kind, time.perf_counter())
    headers = {"Authorization": f"Bearer {req.key}"} if req.key else {}
    try:
        async with s.post(f"{url}/generate", json=req.body(), headers=headers) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = f"HTTP {resp.status}: {(await resp.text())[:160]}"
                return rec
            async for line in resp.content:
                if line.strip() == b"data: [DONE]":
                    rec.done = time.perf_counter()
                    return rec
                if line.startswith(b"data: "):
                    read_chunk(rec, json.loads(line[6:]))
                    if rec.error:
                        return rec
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        rec.error = repr(e)
        return rec
    rec.error = "stream ended without [DONE]"
    return rec


def read_chunk(rec: Rec, chunk: dict[str, Any]) -> None:
    if "error" in chunk:
        err = chunk["error"]
        rec.error = str(err.get("message", err) if isinstance(err, dict) else err)[:200]
        rec.status = err.get("code", rec.status) if isinstance(err, dict) else rec.status
        return
    if len(chunk["output_ids"]) > rec.output_tokens:
        rec.chunks.append(time.perf_counter())
        rec.output_tokens = len(chunk["output_ids"])
    meta = chunk.get("meta_info") or {}
    rec.prompt_tokens, rec.cached_tokens = meta.get("prompt_tokens", 0), meta.get("cached_tokens", 0)


async def closed_loop(url: str, reqs: list[Req], concurrency: int) -> list[Rec]:
    """reqs in order from `concurrency` clients, each sending its next as soon as its last ended."""
    todo, out = iter(reqs), []
    async with session() as s:
        async def client() -> None:
            for req in todo:  # one shared iterator: each client takes the next request
                out.append(await stream(s, url, req))
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return out


def warm(url: str, vocab: int, long_tokens: int, key: str | None = None) -> None:
    rng = random.Random(99)
    warmups = [Req("warm", prompt(rng, 150, vocab), 16, key=key) for _ in range(4)]
    warmups.append(Req("warm", prompt(rng, long_tokens, vocab), 4, key=key))
    asyncio.run(closed_loop(url, warmups, 5))


def prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


# -- summaries --------------------------------------------------------------------------------------


def pct(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None, "n": 0}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"p50": q[49], "p99": q[98], "max": max(values), "n": len(values)}


def latency(recs: list[Rec]) -> dict[str, Any]:
    ok = [r for r in recs if r.ok]
    return {"requests": len(recs), "completed": len(ok), "rejected_503": sum(r.rejected for r in recs),
            "errors": sorted({r.error for r in recs if r.error and not r.rejected})[:3],
            "messages_503": sorted({r.error for r in recs if r.rejected}),
            "ttft_s": pct([r.ttft for r in ok]), "e2e_s": pct([r.e2e for r in ok]),
            "tpot_s": pct([r.tpot for r in ok if r.tpot is not None]),
            "gap_s": pct([g for r in ok for g in r.gaps])}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def ms(d: dict[str, Any], p: str) -> str:
    return "-" if d.get(p) is None else f"{d[p] * 1e3:8.1f}"


def x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


# -- 1. fairness ------------------------------------------------------------------------------------


def fairness_reqs(sz: Sizes, vocab: int, seed: int, with_long: bool) -> list[Req]:
    rng = random.Random(seed)
    shorts = [Req("short", prompt(rng, rng.randint(100, 200), vocab), rng.randint(32, 64)) for _ in range(sz.fair_short)]
    if not with_long:
        return shorts
    longs = iter(Req("long", prompt(rng, sz.long_tokens, vocab), 8) for _ in range(sz.fair_short // 9 + 1))
    out = []
    for i, req in enumerate(shorts):  # a long one after every ninth short one: 10% of all requests
        out += [req, next(longs)] if i % 9 == 4 else [req]
    return out


def fairness(path: Path, sz: Sizes, vocab: int, seed: int) -> dict[str, Any]:
    pool = ["--max-total-tokens", str(sz.concurrency * (sz.long_tokens + 128))]  # every sequence whole: no eviction
    off = ["--max-decode-slowdown", "0"]
    cases = {"short only": ([], False), "short only, slowdown 0": (off, False), "long, slowdown 0": (off, True),
             "long, slowdown 1.5": ([], True)}
    out = {}
    for name, (flags, with_long) in cases.items():
        with server(path, *pool, *flags) as url:
            warm(url, vocab, sz.long_tokens)
            before, t0 = info(url), time.perf_counter()
            recs = asyncio.run(closed_loop(url, fairness_reqs(sz, vocab, seed, with_long), sz.concurrency))
            out[name] = {"flags": flags, "wall_s": time.perf_counter() - t0, "short": latency([r for r in recs if r.kind == "short"]),
                         "long": latency([r for r in recs if r.kind == "long"]), **counters(before, info(url))}
        out[name]["load_avg_1m"] = os.getloadavg()[0]  # other jobs on the box: a high figure taints the case
        print(f"  {name}: {out[name]['wall_s']:.1f} s, {out[name]['forward_steps']} steps, load average"
              f" {out[name]['load_avg_1m']:.1f}", flush=True)
    for case in out.values():  # against the short-only case with the same flags
        base = out["short only" if case["flags"] == [] else "short only, slowdown 0"]["short"]
        case["ratios_to_short_only"] = {f"{m}_{p}": ratio(case["short"][f"{m}_s"][p], base[f"{m}_s"][p])
                                        for m in ("tpot", "gap", "ttft") for p in ("p50", "p99")}
    return out


def print_fairness(res: dict[str, Any]) -> None:
    print(f"{'case':>22s} | {'TPOT ms p50':>11s} {'p99':>8s} {'x':>6s} | {'gap p99':>8s} {'x':>6s} | {'TTFT p50':>8s}"
          f" {'p99':>8s} | {'long TTFT p50':>13s} | done")
    for name, c in res.items():
        s, lo, r = c["short"], c["long"], c["ratios_to_short_only"]
        print(f"{name:>22s} | {ms(s['tpot_s'], 'p50'):>11s} {ms(s['tpot_s'], 'p99')} {x(r['tpot_p99']):>6s} |"
              f" {ms(s['gap_s'], 'p99')} {x(r['gap_p99']):>6s} | {ms(s['ttft_s'], 'p50')} {ms(s['ttft_s'], 'p99')} |"
              f" {ms(lo['ttft_s'], 'p50'):>13s} | {s['completed']}/{s['requests']} + {lo['completed']}/{lo['requests']}")
        for e in s["errors"] + lo["errors"]:
            print(f"{'':>22s} !! {e}")
    on, off = res["short only"]["short"], res["short only, slowdown 0"]["short"]
    print("short only, slowdown 1.5 over slowdown 0: " + ", ".join(
        f"{m.upper()} P99 {x(ratio(on[f'{m}_s']['p99'], off[f'{m}_s']['p99']))}" for m in ("tpot", "ttft", "e2e")))
    print("(x: against the short-only case with the same --max-decode-slowdown)")
    r = res["long, slowdown 1.5"]["ratios_to_short_only"]["tpot_p99"]
    verdict = "-" if r is None else ("MET" if r <= 2 else "MISSED")
    print(f"target (short TPOT P99 with long prompts, default slowdown, within 2x of short only): {x(r)} {verdict}")


# -- 2. priority ------------------------------------------------------------------------------------


async def priority_load(url: str, sz: Sizes, vocab: int, seed: int) -> tuple[list[Rec], int]:
    """The low requests at once, the high ones once a queue formed: records, and `waiting` then."""
    rng = random.Random(seed)
    lows = [Req("low", prompt(rng, rng.randint(100, 200), vocab), sz.prio_out, priority=0) for _ in range(sz.prio_low)]
    highs = [Req("high", prompt(rng, rng.randint(100, 200), vocab), sz.prio_out, priority=100) for _ in range(sz.prio_high)]
    target = min(sz.prio_low - 4, sz.prio_queue_cap) // 2
    async with session() as s:
        tasks = [asyncio.create_task(stream(s, url, r)) for r in lows]
        waiting, deadline = 0, time.monotonic() + 5
        while waiting < target and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            async with s.get(f"{url}/get_server_info") as resp:
                waiting = (await resp.json()).get("waiting", 0)
        tasks += [asyncio.create_task(stream(s, url, r)) for r in highs]
        return list(await asyncio.gather(*tasks)), waiting


def priority(path: Path, sz: Sizes, vocab: int, seed: int) -> dict[str, Any]:
    base = ["--max-running-requests", "4", "--max-total-tokens", "16384"]
    cases = {"baseline": [], "priority": ["--enable-priority-scheduling"],
             "priority + queue cap": ["--enable-priority-scheduling", "--max-queued-requests", str(sz.prio_queue_cap)]}
    out = {}
    for name, flags in cases.items():
        with server(path, *base, *flags) as url:
            warm(url, vocab, sz.long_tokens)
            before = info(url)
            recs, waiting = asyncio.run(priority_load(url, sz, vocab, seed))
            after = info(url)
            t0 = min(r.sent for r in recs)
            timeline = [[r.kind, *(round(t - t0, 3) if t else None for t in (r.sent, r.chunks[0] if r.chunks else None, r.done))]
                        for r in recs]
            out[name] = {"flags": flags, "waiting_when_high_sent": waiting, "timeline_kind_sent_first_done_s": timeline,
                         "retractions": after.get("retractions", 0) - before.get("retractions", 0),
                         **{k: latency([r for r in recs if r.kind == k]) for k in ("low", "high")}}
        out[name]["load_avg_1m"] = os.getloadavg()[0]
        print(f"  {name}: done, load average {out[name]['load_avg_1m']:.1f}", flush=True)
    for c in out.values():
        c["high_over_low"] = {f"{m}_p50": ratio(c["high"][f"{m}_s"]["p50"], c["low"][f"{m}_s"]["p50"]) for m in ("ttft", "e2e")}
        c["high_over_baseline_high"] = {f"{m}_p50": ratio(c["high"][f"{m}_s"]["p50"], out["baseline"]["high"][f"{m}_s"]["p50"])
                                        for m in ("ttft", "e2e")}
    return out


def print_priority(res: dict[str, Any]) -> None:
    print(f"{'case':>20s} {'class':>5s} | {'TTFT ms p50':>11s} {'p99':>8s} | {'E2E ms p50':>10s} {'p99':>8s} |"
          f" {'done':>5s} {'503':>4s} | TTFT p50 high/low, high/baseline high")
    for name, c in res.items():
        for k in ("low", "high"):
            d = c[k]
            tail = (f"{x(c['high_over_low']['ttft_p50'])}, {x(c['high_over_baseline_high']['ttft_p50'])}"
                    f" (queue {c['waiting_when_high_sent']}, retractions {c['retractions']})") if k == "high" else ""
            print(f"{name:>20s} {k:>5s} | {ms(d['ttft_s'], 'p50'):>11s} {ms(d['ttft_s'], 'p99')} | {ms(d['e2e_s'], 'p50'):>10s}"
                  f" {ms(d['e2e_s'], 'p99')} | {d['completed']:2d}/{d['requests']:<2d} {d['rejected_503']:4d} | {tail}")
            for e in d["errors"]:
                print(f"{'':>20s} !! {e}")
            for e in d["messages_503"]:
                print(f"{'':>20s}    503: {e}")


# -- 3. tenants -------------------------------------------------------------------------------------


async def tenant_load(url: str, sz: Sizes, vocab: int, seed: int, keys: dict[str, str | None]) -> list[Rec]:
    """A floods from 4 clients until B has sent its b_requests, each after b_every of A's requests
    ended since B's previous one did."""
    rng = random.Random(seed)
    prefix = prompt(rng, sz.pool // 8, vocab)
    bs = [Req("B", prefix + prompt(rng, 32, vocab), 16, salt="B", key=keys["B"]) for _ in range(sz.b_requests)]
    a_done, out = 0, []

    async with session() as s:
        async def tenant_b() -> None:
            for i, req in enumerate(bs):
                since = a_done  # A's completions counted from the end of B's last request, not from its send
                while i and a_done - since < sz.b_every:
                    await asyncio.sleep(0.01)
                out.append(await stream(s, url, req))

        async def tenant_a(b: asyncio.Task) -> None:
            nonlocal a_done
            while not b.done():
                out.append(await stream(s, url, Req("A", prompt(rng, sz.pool // 16, vocab), 4, salt="A", key=keys["A"])))
                a_done += 1

        b = asyncio.create_task(tenant_b())
        await asyncio.gather(b, *(tenant_a(b) for _ in range(4)))
    return out


def keys_file(tmp: Path) -> tuple[list[str], dict[str, str | None]]:
    path = tmp / "keys.json"
    path.write_text(json.dumps({"key-a": {"tenant": "A", "weight": 1.0, "kv_quota": 0.5},
                                "key-b": {"tenant": "B", "weight": 1.0}}))
    return ["--api-keys-file", str(path)], {"A": "key-a", "B": "key-b"}


def tenants(path: Path, sz: Sizes, vocab: int, seed: int) -> dict[str, Any]:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        no_keys = {"A": None, "B": None}
        cases = {"no quota": ([], no_keys), "--tenant-kv-quota 0.5": (["--tenant-kv-quota", "0.5"], no_keys),
                 "keys file, A kv_quota 0.5": keys_file(Path(tmp))}
        for name, (flags, keys) in cases.items():
            with server(path, "--max-total-tokens", str(sz.pool), *flags) as url:
                warm(url, vocab, sz.pool // 4, key=keys["A"])
                before = info(url, keys["A"])
                t0, recs = time.perf_counter(), asyncio.run(tenant_load(url, sz, vocab, seed, keys))
                out[name] = tenant_summary(recs, time.perf_counter() - t0, before, info(url, keys["A"]))
                out[name]["flags"] = flags
            out[name]["load_avg_1m"] = os.getloadavg()[0]
            print(f"  {name}: {out[name]['wall_s']:.1f} s, {out[name]['forward_steps']} steps,"
                  f" {out[name]['retractions']} retractions, load average {out[name]['load_avg_1m']:.1f}", flush=True)
    return out


def tenant_summary(recs: list[Rec], wall: float, before: dict, after: dict) -> dict[str, Any]:
    b = [r for r in recs if r.kind == "B"]
    warm_b = [r for r in b[1:] if r.ok]  # the first of B's requests fills the cache
    prompt_tokens = sum(r.prompt_tokens for r in warm_b)
    return {"wall_s": wall, "b_hit_rate": sum(r.cached_tokens for r in warm_b) / prompt_tokens if prompt_tokens else None,
            "b_cached_fraction_each": [r.cached_tokens / r.prompt_tokens if r.prompt_tokens else None for r in b],
            "B": latency(b), "A": latency([r for r in recs if r.kind == "A"]),
            **counters(before, after)}


def counters(before: dict, after: dict) -> dict[str, int | None]:
    """What the server's counters moved by during a load (None where /get_server_info was refused)."""
    keys = ("evicted_pages", "forward_steps", "retractions")
    return {k: after[k] - before[k] if k in after and k in before else None for k in keys}


def print_tenants(res: dict[str, Any]) -> None:
    base = res["no quota"]
    print(f"{'case':>26s} | {'B hit':>6s} {'each':>28s} | {'B TTFT p50':>10s} {'p99':>8s} {'x':>6s} | {'B E2E p99':>9s}"
          f" {'x':>6s} | {'A done':>6s} {'A E2E p50':>9s} | evicted")
    for name, c in res.items():
        b = c["B"]
        each = " ".join("-" if f is None else f"{f:.2f}" for f in c["b_cached_fraction_each"])
        hit = "-" if c["b_hit_rate"] is None else f"{c['b_hit_rate']:.1%}"
        print(f"{name:>26s} | {hit:>6s} {each:>28s} | {ms(b['ttft_s'], 'p50'):>10s} {ms(b['ttft_s'], 'p99')}"
              f" {x(ratio(b['ttft_s']['p99'], base['B']['ttft_s']['p99'])):>6s} | {ms(b['e2e_s'], 'p99'):>9s}"
              f" {x(ratio(b['e2e_s']['p99'], base['B']['e2e_s']['p99'])):>6s} | {c['A']['completed']:6d}"
              f" {ms(c['A']['e2e_s'], 'p50'):>9s} | {c['evicted_pages']}")
        for e in b["errors"] + c["A"]["errors"]:
            print(f"{'':>26s} !! {e}")


# -- results --------------------------------------------------------------------------------------


def plot_fairness(ax: Any, model: str, fair: dict[str, Any]) -> None:
    colors = ["gray", "silver", "tab:red", "tab:green"][-len(fair):]
    bars = ax.bar(list(fair), [c["short"]["tpot_s"]["p99"] * 1e3 for c in fair.values()], color=colors)
    ax.bar_label(bars, fmt="%.1f", fontsize=8)
    ax.axhline(2e3 * fair["short only"]["short"]["tpot_s"]["p99"], ls="--", color="k", lw=1, label="2x short only")
    ax.set(ylabel="short requests' TPOT P99 (ms)", title=f"{model}: decode fairness (10% long prompts)")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=8)


def plot_priority(ax: Any, model: str, prio: dict[str, Any]) -> None:
    width = 0.2
    for i, (k, m) in enumerate((("low", "ttft_s"), ("high", "ttft_s"), ("low", "e2e_s"), ("high", "e2e_s"))):
        vals = [(c[k][m]["p50"] or 0) * 1e3 for c in prio.values()]
        ax.bar([j + (i - 1.5) * width for j in range(len(prio))], vals, width, label=f"{k} {m[:-2].upper()} P50")
    ax.set_xticks(range(len(prio)), list(prio), fontsize=8)
    ax.set(ylabel="ms", title=f"{model}: low (0) vs high (100) priority, 4 running")
    ax.legend(fontsize=8)


def plot_tenants(ax: Any, model: str, ten: dict[str, Any]) -> None:
    bars = ax.bar(list(ten), [100 * (c["b_hit_rate"] or 0) for c in ten.values()], color=["gray", "tab:green", "tab:blue"])
    ax.bar_label(bars, fmt="%.0f%%", fontsize=8)
    ax.set_xticks(range(len(ten)), list(ten), fontsize=8)
    ax.set(ylim=(0, 105), ylabel="B's cache hit rate (%)", title=f"{model}: tenant B while A floods the pool")


PANELS = {"fairness": plot_fairness, "priority": plot_priority, "tenants": plot_tenants}


def plot(models: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.2 * len(models)), squeeze=False)
    for row, (model, res) in zip(axes, models.items()):
        for ax, (key, panel) in zip(row, PANELS.items()):
            if key in res and "error" not in res[key]:
                panel(ax, model, res[key])
            else:
                ax.set_title(f"{model}: {key} did not run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def save(key: str, result: dict[str, Any], cpu: dict[str, Any]) -> None:
    path = RESULTS / "scheduling.json"
    models = json.loads(path.read_text()).get("models", {}) if path.exists() else {}
    models[key] = models.get(key, {}) | result  # a run of some --items keeps the model's other items
    print("\nwrote", write_result("scheduling", {"host": cpu, "dp": DP_NOTE, "models": models}))
    plot(models, RESULTS / "scheduling.png")
    print("wrote", RESULTS / "scheduling.png")


def model_path(name: str) -> Path:
    """The peers' tiny/small checkpoint, else the builder's stand-in, or a directory as given."""
    if Path(name).expanduser().is_dir():
        return Path(name).expanduser()
    peers = Path(os.environ.get("RADIXRT_PEERS", Path.home() / ".cache" / "radixrt-peers")) / "models" / name
    if (peers / "config.json").exists():
        return peers
    return ensure_model("llama", {"tiny": "tiny", "small": "100m"}[name])


def run_model(name: str, sz: Sizes, seed: int, only: set[str]) -> dict[str, Any]:
    path = model_path(name)
    vocab = min(json.loads((path / "config.json").read_text())["vocab_size"], 8000)
    print(f"\n== {name} ({path}), bf16, load average {os.getloadavg()[0]:.1f}; {sz}", flush=True)
    res: dict[str, Any] = {"path": str(path), "sizes": asdict(sz), "seed": seed}
    items = {"fairness": ("1. fairness: short requests' TPOT alone and with 10% long prompts", fairness, print_fairness),
             "priority": (f"2. priority: {sz.prio_low} low (0) then {sz.prio_high} high (100), --max-running-requests 4",
                          priority, print_priority),
             "tenants": ((f"3. tenants: pool {sz.pool} tokens, A floods {sz.pool // 16}-token prompts, B reuses a"
                          f" {sz.pool // 8}-token prefix every {sz.b_every} of A's"), tenants, print_tenants)}
    for key, (title, run, show) in items.items():
        if key not in only:
            continue
        print(f"\n-- {title}", flush=True)
        try:  # one item's failure (a server that does not start) leaves the others' figures
            res[key] = run(path, sz, vocab, seed)
        except (RuntimeError, OSError, aiohttp.ClientError) as e:
            res[key] = {"error": str(e)[-2000:]}
            print(f"!! {key} failed: {str(e)[-1500:]}")
            continue
        show(res[key])
    print(f"\n-- 4. {DP_NOTE}")
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,small", help="comma-separated: tiny, small or checkpoint directories")
    parser.add_argument("--quick", action="store_true", help="fewer requests, for a smoke run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the server's processes (OMP_NUM_THREADS)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--items", default="fairness,priority,tenants", help="which experiments to run (default: all)")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the servers and their workers
    cpu = host() | {"threads": args.threads}
    print(f"host: {cpu['cpu']}, flags {' '.join(cpu['flags']) or '(none of avx2/avx512/amx)'}, {cpu['cores']} cores,"
          f" {args.threads} torch thread(s) per server process")
    for name in args.models.split(","):
        sz = SIZES["tiny" if name == "tiny" else "small", "quick" if args.quick else "full"]
        start = time.perf_counter()
        res = run_model(name, sz, args.seed, set(args.items.split(",")))
        res["total_s"] = time.perf_counter() - start
        print(f"\n{name}: {res['total_s']:.0f} s")
        save(f"{name}-quick" if args.quick else name, res, cpu)


if __name__ == "__main__":
    main()

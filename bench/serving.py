"""Online serving: an open-loop load generator against a running `radixrt launch_server`.

Requests arrive as a Poisson process at a given rate and are sent at their
arrival times whether or not earlier ones have finished (open loop: a slow
server builds a queue instead of slowing the client down). Each request streams
from the native `POST /generate`; the client records when it sent the request,
when the first chunk with a token came, when the stream ended, and how many
tokens it got. From those, per load:

  TTFT   time to first token: send -> first chunk carrying an output token
  TPOT   time per output token after the first: (E2E - TTFT) / (tokens - 1),
         over requests with more than one output token
  E2E    end-to-end latency: send -> last chunk
  throughput  output tokens / s and requests / s, from the first send to the
         last completion

each as P50/P95/P99 over the requests that completed.

Beside them, per load, the server's own figures (bench/server_figures.py): TTFT, TPOT,
queueing and E2E P50/P95/P99 from what its /metrics histograms observed during the load
(a scrape before, one after, their difference), and its KV and memory peaks from
/get_server_info (used_pages polled about every 100 ms during the load; kv_peak_used_pages,
num_pages, the worker's RSS and device-memory peaks and memory_limit_bytes after it). The
server's percentiles are Prometheus' histogram_quantile: linear interpolation inside the
bucket that holds the percentile, so they agree with the client's to within a bucket (the
client's also carry the HTTP hop). Queueing exists only on the server's side: arrival at the
scheduler to the request's first schedule. A metric or key an older server lacks is None in
the JSON and "-" in the table.

Workloads (seeded; greedy, ignore_eos, page size 16; the pool holds every
sequence of a load whole, so nothing is evicted or retracted):

  rate sweep       random unique prompts of 100-400 tokens (vocab 1000), 32-64
                   output tokens, the same requests at each of a few rates, one
                   server for the sweep (cache flushed between rates). The
                   lowest rate is light; the highest saturates the tiny model on
                   the shared 2-vCPU machine (achieved req/s falls behind offered).
                   The seeded arrival gaps are the same at every rate, scaled by 1/rate.
  shared_document  questions over one 1,500-token document (tests/support/workloads.py),
                   16 output tokens, one fixed rate, against a server with the
                   radix cache on and then a fresh one with --disable-radix-cache,
                   in the same run; prints both and the ratios (on / off), and
                   the hit rate from /get_server_info's counters over the load.
                   The rate is chosen above what the server sustains without the
                   cache and below what it sustains with it: in an open loop both
                   deliver the offered rate until one saturates, so the
                   throughput ratio depends on that choice; the latency ratios
                   are the steadier figure.

Each load is bounded: a fixed number of requests and a wall-clock cap (requests
still streaming at the cap are cut and counted as unfinished). Everything goes
to 127.0.0.1. Before each load two short requests warm the server, then the
cache is flushed. The server's torch runs --threads intra-op threads (1 by
default; see bench/prefix_reuse.py for why). NOTE: the client shares the machine
with the server (and, on the dev box, with other jobs), so absolute figures are
noisy; compare the ratios taken within one run. The "client lag" column (the
latest a request was sent after its arrival time) shows whether the client
itself kept up.

Results merge per model into bench/results/serving.json (each load's server figures
under its "server" key), with latency against request rate and the cache on/off bars
in bench/results/serving.png.

    .venv/bin/python bench/serving.py [--model tiny|100m] [--quick] [--rates 2,8,16,32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import requests
from common import ROOT, ClientTimes, Poller, ensure_model, random_prompts, save_model_result
from server_figures import POLL_S, figures_table, ms, scrape, server_figures, server_info

sys.path.insert(0, str(ROOT / "tests"))
from support.helpers import corpus_ids  # noqa: E402
from support.server_proc import running_server  # noqa: E402
from support.workloads import shared_document  # noqa: E402

PAGE = 16
WARMUP_PROMPTS = [list(range(3, 40)), list(range(50, 70))]


@dataclass(frozen=True)
class Sizes:
    rates: tuple[float, ...]  # req/s for the sweep
    sweep_requests: int  # per rate
    doc_rate: float  # req/s for shared_document
    doc_requests: int
    cap_s: float  # wall-clock cap per load


SIZES = {
    # Measured on the shared 2-vCPU box (1 torch thread): the tiny model keeps up with 20-35
    # req/s of the sweep's requests (it varies with the other jobs); on shared_document with
    # 7-10 req/s with the cache off and well over 16 with it on, so 16 req/s overloads only
    # the server without the cache.
    "tiny": Sizes(rates=(4, 16, 32, 64), sweep_requests=128, doc_rate=16, doc_requests=128, cap_s=90),
    # llama-100m (bf16, 1 thread) decodes at ~110 ms/token even alone and saturates near 1 req/s;
    # at 0.5 req/s shared_document does not overload it even without the cache (run time ~3 min).
    "100m": Sizes(rates=(0.5, 1, 2), sweep_requests=16, doc_rate=0.5, doc_requests=16, cap_s=45),
    "quick": Sizes(rates=(4, 16), sweep_requests=16, doc_rate=8, doc_requests=16, cap_s=30),
}


@dataclass(frozen=True)
class Load:
    """What to send: one prompt and one output length per request, in arrival order."""

    name: str
    prompts: list[list[int]]
    max_new: list[int]

    def pool_tokens(self) -> int:
        """KV tokens for every sequence whole (page rounding and a copy-on-write page each)."""
        return sum((-(-(len(p) + n) // PAGE) + 1) * PAGE for p, n in zip(self.prompts, self.max_new))


@dataclass(frozen=True)
class Record(ClientTimes):
    """One request as the client saw it; times in seconds, from the load's start."""

    arrival: float  # when the Poisson process said to send it
    sent: float
    first: float | None = None  # first chunk with an output token
    done: float | None = None  # end of the stream ([DONE])
    output_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.done is not None and self.first is not None and self.error is None



# -- workloads ---------------------------------------------------------------------------


def sweep_load(n: int, seed: int) -> Load:
    rng = random.Random(seed)
    return Load("random", random_prompts(n, 100, 400, vocab=1000, seed=seed), [rng.randint(32, 64) for _ in range(n)])


def document_load(path: Path, n: int) -> Load:
    return Load("shared_document", shared_document(corpus_ids(path), n).prompts, [16] * n)


# -- the client: one load against one URL ----------------------------------------------------


async def stream_request(session: aiohttp.ClientSession, url: str, ids: list[int], max_new: int,
                         arrival: float, t0: float) -> Record:
    """Wait for the arrival time, send, and read the SSE stream to [DONE]."""
    await asyncio.sleep(max(0.0, t0 + arrival - time.perf_counter()))
    sent = time.perf_counter()
    rec = Record(arrival, sent - t0)
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}}
    try:
        async with session.post(f"{url}/generate", json=body) as resp:
            if resp.status != 200:
                return replace(rec, error=f"HTTP {resp.status}: {(await resp.text())[:200]}")
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                if line.strip() == b"data: [DONE]":
                    return replace(rec, done=time.perf_counter() - t0)
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return replace(rec, error=str(chunk["error"]))
                if rec.first is None and chunk["output_ids"]:
                    rec = replace(rec, first=time.perf_counter() - t0)
                rec = replace(rec, output_tokens=len(chunk["output_ids"]))
    except aiohttp.ClientError as e:
        return replace(rec, error=repr(e))
    return replace(rec, error="stream ended without [DONE]")


async def send_load(url: str, load: Load, rate: float, seed: int, cap_s: float) -> tuple[list[Record], int]:
    """Send load at Poisson arrivals of `rate` req/s: the records of requests that ended (ok or failed), and
    how many were still waiting or streaming at the wall-clock cap (those are cancelled)."""
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in load.prompts:
        arrivals.append(t)
        t += rng.expovariate(rate)
    # limit=0: no connection pool limit, or the pool would close the loop.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=None)) as session:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(stream_request(session, url, p, n, a, t0))
                 for p, n, a in zip(load.prompts, load.max_new, arrivals)]
        done, pending = await asyncio.wait(tasks, timeout=cap_s)
        for task in pending:  # closing the stream makes the server abort the request
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    return [task.result() for task in tasks if task in done], len(pending)


def run_load(url: str, load: Load, rate: float, seed: int, cap_s: float) -> dict[str, Any]:
    """Warm up, flush the cache, send the load while polling the server's KV use, and summarize it
    with the server's counters and figures (its /metrics scraped before and after)."""
    for ids in WARMUP_PROMPTS:
        requests.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 4}}, timeout=60)
    requests.post(f"{url}/flush_cache", timeout=60).raise_for_status()
    before, scrape_before = requests.get(f"{url}/get_server_info", timeout=60).json(), scrape(url)
    with Poller(lambda: server_info(url, timeout=2), "used_pages", POLL_S, limit_s=cap_s) as kv:
        records, cut = asyncio.run(send_load(url, load, rate, seed, cap_s))
    after, scrape_after = requests.get(f"{url}/get_server_info", timeout=60).json(), scrape(url)
    return {**summarize(records, cut, rate, before, after),
            "server": server_figures(scrape_before, scrape_after, after, kv.peak)}


# -- summaries --------------------------------------------------------------------------------


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    if len(values) == 1:
        return dict.fromkeys(("p50", "p95", "p99"), values[0])
    q = statistics.quantiles(values, n=100, method="inclusive")
    return {"p50": q[49], "p95": q[94], "p99": q[98]}


def summarize(records: list[Record], cut: int, rate: float, before: dict, after: dict) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    span = max(r.done for r in ok) - min(r.sent for r in records) if ok else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    return {
        "rate": rate,
        "requests": len(records) + cut,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "cut_at_cap": cut,
        "errors": sorted({r.error for r in records if r.error})[:3],
        "duration_s": span,
        "req_s": len(ok) / span if span else 0.0,
        "output_tok_s": out_tokens / span if span else 0.0,
        "ttft_s": percentiles([r.ttft for r in ok]),
        "tpot_s": percentiles([r.tpot for r in ok if r.tpot is not None]),
        "e2e_s": percentiles([r.e2e for r in ok]),
        "client_lag_max_s": max((r.sent - r.arrival for r in records), default=0.0),
        "hit_rate": (after["cached_prompt_tokens"] - before["cached_prompt_tokens"]) / prompt if prompt else 0.0,
        "retractions": after["retractions"] - before["retractions"],
    }


def print_rows(label: str, rows: dict[str, dict[str, Any]]) -> None:
    print(f"{label:>8s} {'done':>7s} {'req/s':>6s} {'tok/s':>6s} | {'TTFT ms p50/p95/p99':>20s} |"
          f" {'TPOT ms p50/p95/p99':>20s} | {'E2E ms p50/p95/p99':>20s} | {'hit':>5s} {'lag ms':>6s}")
    for name, s in rows.items():
        print(f"{name:>8s} {s['completed']:3d}/{s['requests']:<3d} {s['req_s']:6.1f} {s['output_tok_s']:6.0f} |"
              f" {ms(s['ttft_s'])} | {ms(s['tpot_s'])} | {ms(s['e2e_s'])} | {s['hit_rate']:5.1%}"
              f" {s['client_lag_max_s'] * 1e3:6.0f}")
        if s["failed"] or s["cut_at_cap"]:
            print(f"         !! {s['failed']} failed, {s['cut_at_cap']} cut at the wall-clock cap: {s['errors']}")
    for name, s in rows.items():
        print(f"\n{label} {name}: client vs server")
        print("\n".join(f"  {line}" for line in figures_table(s, s.get("server", {}))))


# -- the two experiments ----------------------------------------------------------------------


def server_args(dtype: str, load: Load, *extra: str) -> list[str]:
    return ["--dtype", dtype, "--page-size", str(PAGE), "--max-total-tokens", str(load.pool_tokens()), *extra]


def rate_sweep(path: Path, dtype: str, sizes: Sizes, seed: int) -> list[dict[str, Any]]:
    load = sweep_load(sizes.sweep_requests, seed)
    print(f"\n-- rate sweep: {len(load.prompts)} random prompts of 100-400 tokens, 32-64 output tokens,"
          f" at {', '.join(f'{r:g}' for r in sizes.rates)} req/s (one server)")
    with running_server(path, *server_args(dtype, load)) as (url, _):
        rows = {f"{r:g}/s": run_load(url, load, r, seed, sizes.cap_s) for r in sizes.rates}
    print_rows("rate", rows)
    return list(rows.values())


def cache_on_off(path: Path, dtype: str, sizes: Sizes, seed: int) -> dict[str, Any]:
    load = document_load(path, sizes.doc_requests)
    print(f"\n-- shared_document: {len(load.prompts)} questions over one 1500-token document, 16 output tokens,"
          f" {sizes.doc_rate:g} req/s, radix cache on then off (a fresh server each)")
    runs = {}
    for name, extra in (("on", ()), ("off", ("--disable-radix-cache",))):
        with running_server(path, *server_args(dtype, load, *extra)) as (url, _):
            runs[name] = run_load(url, load, sizes.doc_rate, seed, sizes.cap_s)
    print_rows("cache", runs)
    on, off = runs["on"], runs["off"]
    ratios = {f"{m}_{p}_off_over_on": off[f"{m}_s"][p] / on[f"{m}_s"][p] for m in ("ttft", "e2e") for p in ("p50", "p99")}
    ratios["output_tok_s_on_over_off"] = on["output_tok_s"] / off["output_tok_s"]
    print("cache on vs off: " + ", ".join(
        f"{m.upper()} {ratios[f'{m}_p50_off_over_on']:.2f}x lower at P50 ({ratios[f'{m}_p99_off_over_on']:.2f}x at P99)"
        for m in ("ttft", "e2e")), end="")
    print(f", throughput {ratios['output_tok_s_on_over_off']:.2f}x; hit rate {on['hit_rate']:.1%} (off: {off['hit_rate']:.1%})")
    return {"rate": sizes.doc_rate, "requests": len(load.prompts), "on": on, "off": off, "ratios": ratios}


# -- results ---------------------------------------------------------------------------------------


def plot_sweep(ax: Any, model: str, sweep: list[dict[str, Any]]) -> None:
    rates = [s["rate"] for s in sweep]
    for metric, color in (("ttft_s", "tab:blue"), ("e2e_s", "tab:orange")):
        for p, style in (("p50", "-o"), ("p99", "--s")):
            ax.plot(rates, [s[metric][p] * 1e3 for s in sweep], style, color=color, label=f"{metric[:-2].upper()} {p.upper()}")
    ax.set(xscale="log", yscale="log", xlabel="offered request rate (req/s)", ylabel="latency (ms)",
           title=f"llama-{model}: latency vs request rate (random prompts)")
    ax.set_xticks(rates, [f"{r:g}" for r in rates])
    ax.tick_params(axis="x", which="minor", labelbottom=False)  # log scale's own labels would overlap
    ax.legend(fontsize=8)


def plot_cache(ax: Any, model: str, doc: dict[str, Any]) -> None:
    names = ["TTFT P50 (ms)", "TTFT P99 (ms)", "E2E P50 (ms)", "E2E P99 (ms)", "output tok/s"]
    for i, cache in enumerate(("on", "off")):
        r = doc[cache]
        vals = [r[m][p] * 1e3 for m in ("ttft_s", "e2e_s") for p in ("p50", "p99")] + [r["output_tok_s"]]
        bars = ax.bar([x + (i - 0.5) * 0.38 for x in range(len(names))], vals, 0.38, label=f"radix cache {cache}")
        ax.bar_label(bars, fmt="%.0f", fontsize=7)
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set(yscale="log", title=f"llama-{model}: shared_document at {doc['rate']:g} req/s, cache on vs off (log scale)")
    ax.legend(fontsize=8)


def plot(models: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(models), 2, figsize=(13, 4.5 * len(models)), squeeze=False)
    for (left, right), (model, res) in zip(axes, models.items()):
        plot_sweep(left, model, res["sweep"])
        plot_cache(right, model, res["shared_document"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "100m"), default="tiny")
    parser.add_argument("--quick", action="store_true", help="few requests at two rates, for a smoke run")
    parser.add_argument("--rates", help="comma-separated req/s for the sweep (default: per model)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads in the server's processes (OMP_NUM_THREADS)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the server and its workers
    sizes = SIZES["quick" if args.quick else args.model]
    if args.rates:
        sizes = replace(sizes, rates=tuple(float(r) for r in args.rates.split(",")))
    path = ensure_model("llama", args.model)
    dtype = "float32" if args.model == "tiny" else "bfloat16"
    load_avg = os.getloadavg()
    print(f"== llama-{args.model} ({dtype}), greedy, page size {PAGE}, {args.threads} torch thread(s), seed {args.seed};"
          f" machine load average {load_avg[0]:.1f} on {os.cpu_count()} CPUs before the run")
    print(f"sizes: {sizes}")
    start = time.perf_counter()
    sweep = rate_sweep(path, dtype, sizes, args.seed)
    doc = cache_on_off(path, dtype, sizes, args.seed)
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    key = f"{args.model}-quick" if args.quick else args.model
    save_model_result("serving", key, {"dtype": dtype, "threads": args.threads, "seed": args.seed, "load_avg_before": load_avg[0],
               "sizes": asdict(sizes), "sweep": sweep, "shared_document": doc}, plot)


if __name__ == "__main__":
    main()

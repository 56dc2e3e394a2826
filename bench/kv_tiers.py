"""KV tiers on a multi-tenant trace: hit rate per tier and eviction policy, against tiers off.

The trace is scripts/gen_tenant_trace.py's (seeded; --trace reads a JSONL file instead): tenants'
system prompts and Zipf-popular documents, one-off uploads and multi-turn chats, interleaved.
Its working set W is the distinct full prompt pages of the whole trace (page size 16). Every run
has the same device pool, W/4 pages (max_total_tokens); with tiers, the host tier holds W/2
(hicache_ratio 2.0: twice the device pool) and the disk tier in a temp dir holds 2 W (never
full: "unbounded").

Runs, one Engine each, on the tiny llama (--size 100m: llama-100m) with the radix cache on:
  off               no lower tiers (the baseline: throughput ratios are against it)
  <policy>          tiers on, --radix-eviction-policy <policy> for each of lru, lfu, cost
  lru-nopin         tiers on, lru, the trace's pinned requests sent without cache_control: their
                    TTFT against lru's is what the pins did
  <policy>+<write>  tiers on, --hicache-write-policy <write> (write_through, write_back) under lru
A run whose flag or value ServerArgs does not take yet is skipped and says why; until the
radix_eviction_policy flag exists, "lru" runs the server's only (LRU) policy without the flag.

The client sends the trace in order, --concurrency requests at a time (closed loop), each
streamed through Engine.async_generate with its tenant as cache_salt; a chat turn waits for its
previous turn. TTFT: submission to the first chunk with a token. Pinned requests carry the trace's
cache_control when Engine.generate takes that parameter (else they run unpinned, and the TTFT
split only tells the pinned prefixes' requests from the others); a pin the server refuses is
counted and the request resent without it.

Hit rates are shares of the prompt tokens, from the scheduler's counters (get_server_info, deltas
over the run): host = host_hit_pages * 16, disk = disk_hit_pages * 16, device = cached_prompt_tokens
- host - disk (loaded pages count as cached tokens). Figures read when the server has them:
unreachable* and cost_* / pinned_* / pin_* (end of run), tier_load* / tier_recompute* (deltas).
Throughput counts prompt + output tokens over the run's wall time (the same trace in every run, so
the req/s ratio equals the tok/s ratio). --rounds N runs everything N times, interleaved, and shows
each run's median-tok/s round.

Torch runs --threads intra-op threads (OMP_NUM_THREADS, inherited by the engines), 1 by default.
NOTE: the engines' step loop is latency bound on the tiny model; on a busy machine its throughput
falls several times over (measured on 2 cores, tiers off: 43k tok/s on a 40-request trace when
quiet, 2.6-5k tok/s on these traces at load 4-7). Read ratios from one run on a quiet machine, with
--rounds 3 where it is not. Writes bench/results/kv_tiers.json and bench/results/kv_tiers.png.

    .venv/bin/python bench/kv_tiers.py            # 360 requests, every run (~1.5-3 min on 2 cores)
    .venv/bin/python bench/kv_tiers.py --quick    # 120 requests (examples/data/tenant_trace.jsonl's
                                                  # trace), off + the eviction policies only
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import math
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common import RESULTS, ensure_model, write_result
from gen_tenant_trace import TraceSpec, make_trace, read_jsonl, summary, working_set_pages  # scripts/ via common

PAGE = 16
DTYPES = {"llama-tiny": "float32", "llama-100m": "bfloat16"}  # as the builder makes them
POLICIES = ("lru", "lfu", "cost")
WRITE_POLICIES = ("write_through", "write_back")
COUNTERS = ("prompt_tokens", "cached_prompt_tokens", "host_hit_pages", "disk_hit_pages", "pages_d2h", "pages_h2d",
            "pages_h2disk", "pages_d2disk", "pages_disk2d", "pages_drop", "evicted_pages", "tier_move_seconds",
            "retractions", "recomputed_tokens")
DELTA_PREFIXES = ("tier_load", "tier_recompute")  # counters another change adds: deltas over the run
END_PREFIXES = ("cost_", "unreachable", "pinned_", "pin_")  # gauges / measured costs: the value at the end


@dataclass(frozen=True)
class RunConfig:
    """One Engine run: its name, its server arguments past the common ones, and tiers on or off."""

    name: str
    server: dict[str, Any] = field(default_factory=dict)
    tiers: bool = True
    pins: bool = True  # send the trace's cache_control (False: the same requests, unpinned)


def run_configs(quick: bool) -> list[RunConfig]:
    """off, each eviction policy with tiers, and (not --quick) each write policy under lru."""
    runs = [RunConfig("off", {}, tiers=False)]
    runs += [RunConfig(p, {"radix_eviction_policy": p}) for p in POLICIES]
    runs.append(RunConfig("lru-nopin", {"radix_eviction_policy": "lru"}, pins=False))  # the pinned prefixes unpinned
    if not quick:
        runs += [RunConfig(f"lru+{w}", {"radix_eviction_policy": "lru", "hicache_write_policy": w}) for w in WRITE_POLICIES]
    return runs


def unsupported(model: Path, server: dict[str, Any]) -> str | None:
    """Why ServerArgs refuses these arguments (a flag or value not there yet), None if it takes them."""
    from radixrt.config import ServerArgs

    try:
        ServerArgs.from_kwargs(model_path=str(model), **server)
    except (TypeError, ValueError) as e:
        return str(e)
    return None


def resolve(model: Path, cfg: RunConfig) -> tuple[RunConfig | None, str | None]:
    """cfg as it can run now, or (None, why not). Without the radix_eviction_policy flag at all,
    lru runs without it (LRU is then the only policy) and the others are skipped."""
    why = unsupported(model, cfg.server)
    if why is None:
        return cfg, None
    if cfg.server.get("radix_eviction_policy") == "lru" and "radix_eviction_policy" in why:
        rest = {k: v for k, v in cfg.server.items() if k != "radix_eviction_policy"}
        if unsupported(model, rest) is None:
            return dataclasses.replace(cfg, server=rest), "no radix_eviction_policy flag: the server's only policy (LRU)"
    return None, why


# -- the client ------------------------------------------------------------------------------------


@dataclass
class Done:
    """One finished request as the client saw it."""

    pinned: bool
    ttft_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    pin_refused: str | None = None


async def stream_one(engine: Any, req: dict, pin: bool) -> Done:
    extra = {"cache_control": req["cache_control"]} if pin else {}
    sampling = {"max_new_tokens": req["max_new_tokens"], "temperature": 0, "ignore_eos": True}
    start, first, last = time.perf_counter(), None, None
    async for chunk in await engine.async_generate(input_ids=req["input_ids"], sampling_params=sampling, stream=True,
                                                   cache_salt=req["tenant"], **extra):
        if first is None and chunk["output_ids"]:
            first = time.perf_counter()
        last = chunk
    meta = last["meta_info"]
    finish = meta["finish_reason"] or {}
    if finish.get("type") == "abort" or first is None:
        raise RuntimeError(f"request {req['id']} did not complete: {finish}")
    return Done(req["pinned"], first - start, meta["prompt_tokens"], meta["completion_tokens"], meta["cached_tokens"])


async def send(engine: Any, req: dict, pins: bool) -> Done:
    """req, pinned if the trace and the Engine say so; a refused pin is counted and sent without."""
    if not (pins and req["pinned"]):
        return await stream_one(engine, req, pin=False)
    try:
        return await stream_one(engine, req, pin=True)
    except (ValueError, RuntimeError) as e:  # RequestError (400) at submission, or an abort naming the budget
        done = await stream_one(engine, req, pin=False)
        done.pin_refused = str(e)
        return done


async def drive(engine: Any, trace: list[dict], concurrency: int, pins: bool) -> list[Done]:
    """The trace in order, `concurrency` at a time; a chat turn starts after its previous turn ends."""
    sem = asyncio.Semaphore(concurrency)
    ended = {(r["conversation"], r["turn"]): asyncio.Event() for r in trace if r["conversation"]}

    async def one(req: dict) -> Done:
        conv = req["conversation"]
        if conv and req["turn"] > 0:
            await ended[(conv, req["turn"] - 1)].wait()
        async with sem:
            done = await send(engine, req, pins)
        if conv:
            ended[(conv, req["turn"])].set()
        return done

    return await asyncio.gather(*(one(r) for r in trace))


# -- one run ---------------------------------------------------------------------------------------


def engine_kwargs(model: Path, cfg: RunConfig, device_pages: int, disk_dir: str, disk_gb: float) -> dict[str, Any]:
    kw = dict(model_path=str(model), dtype=DTYPES[model.name], page_size=PAGE, max_total_tokens=device_pages * PAGE,
              log_level="warning", **cfg.server)
    if cfg.tiers:
        kw.update(enable_hierarchical_cache=True, hicache_ratio=2.0, hicache_dir=disk_dir, hicache_disk_size=disk_gb)
    return kw


def pins_supported() -> bool:
    from radixrt.engine import GenerateArgs

    return "cache_control" in {f.name for f in dataclasses.fields(GenerateArgs)}


def run_one(model: Path, cfg: RunConfig, trace: list[dict], args: argparse.Namespace, sizing: dict) -> dict[str, Any]:
    import radixrt

    with tempfile.TemporaryDirectory(prefix="kv_tiers_disk_") as disk:
        kw = engine_kwargs(model, cfg, sizing["device_pages"], disk, sizing["disk_gb"])
        with radixrt.Engine(**kw) as engine:
            engine.generate(input_ids=[list(range(3, 40))], sampling_params={"max_new_tokens": 2})  # warm-up
            engine.flush_cache()
            before = engine.get_server_info()
            check_sizes(cfg, before, sizing)
            start = time.perf_counter()
            done = asyncio.run(drive(engine, trace, args.concurrency, sizing["pins"] and cfg.pins))
            wall = time.perf_counter() - start
            after = engine.get_server_info()
    return summarize(done, wall, before, after)


def check_sizes(cfg: RunConfig, info: dict, sizing: dict) -> None:
    """The pools the server made are the ones asked for (a silent change would skew every ratio)."""
    assert info["num_pages"] == sizing["device_pages"], (info["num_pages"], sizing["device_pages"])
    if cfg.tiers:
        assert info["host_pages"] == 2 * sizing["device_pages"], (info["host_pages"], sizing["device_pages"])
        assert info["disk_pages"] >= sizing["working_set_pages"], (info["disk_pages"], sizing["working_set_pages"])


def summarize(done: list[Done], wall: float, before: dict, after: dict) -> dict[str, Any]:
    from radixrt.ops.tune_metrics import percentile

    d = {k: after.get(k, 0) - before.get(k, 0) for k in COUNTERS}
    prompt = d["prompt_tokens"]
    host, disk = d["host_hit_pages"] * PAGE, d["disk_hit_pages"] * PAGE
    tokens = sum(x.prompt_tokens + x.completion_tokens for x in done)
    ttft = {}
    for label, group in (("pinned", [x for x in done if x.pinned]), ("unpinned", [x for x in done if not x.pinned])):
        times = [x.ttft_s for x in group]
        ttft[label] = {"n": len(times), "p50_ms": ms(percentile(times, 50)), "p99_ms": ms(percentile(times, 99))}
    extra = {k: v for k, v in after.items() if k.startswith(END_PREFIXES)}
    extra.update({k: v - before.get(k, 0) for k, v in after.items() if k.startswith(DELTA_PREFIXES)})
    return {
        "wall_s": wall, "requests": len(done), "tok_s": tokens / wall, "req_s": len(done) / wall,
        "hit_rate": {"device": (d["cached_prompt_tokens"] - host - disk) / prompt, "host": host / prompt,
                     "disk": disk / prompt, "total": d["cached_prompt_tokens"] / prompt},
        "computed_prompt_tokens": prompt - d["cached_prompt_tokens"],
        "client_cached_tokens": sum(x.cached_tokens for x in done),
        "ttft": ttft, "pins_refused": [x.pin_refused for x in done if x.pin_refused],
        "counters": d, "reported": extra,
    }


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


# -- report ----------------------------------------------------------------------------------------


def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def print_table(result: dict[str, Any]) -> None:
    s, z = result["trace"], result["sizing"]
    print(f"\n-- trace: {s['requests']} requests ({s['kinds']}), {s['distinct_prefixes']} distinct shared prefixes, "
          f"{s['pinned']} pinned; working set {z['working_set_pages']} pages; device pool {z['device_pages']} pages (1/4), "
          f"host {2 * z['device_pages']} (1/2), disk {z['disk_gb'] * 1024:.0f} MiB (>= 2x); concurrency "
          f"{result['concurrency']}; pins {'sent as cache_control' if z['pins'] else 'NOT sent (Engine has no cache_control)'}")
    print(f"{'run':18s} {'tok/s':>7s} {'vs off':>7s} {'req/s':>6s} {'hit dev':>8s} {'host':>6s} {'disk':>6s} {'total':>6s}"
          f" {'computed':>9s} {'pin p50/p99 ms':>15s} {'unpin p50/p99 ms':>17s} {'unreach':>8s} {'wall s':>7s}")
    for name, r in result["runs"].items():
        h, t = r["hit_rate"], r["ttft"]
        unreach = r["reported"].get("unreachable_pages")
        print(f"{name:18s} {r['tok_s']:7.0f} {r['tok_s_vs_off']:6.2f}x {r['req_s']:6.1f} {h['device']:8.3f} {h['host']:6.3f}"
              f" {h['disk']:6.3f} {h['total']:6.3f} {r['computed_prompt_tokens']:9d}"
              f" {fmt_ms(t['pinned']['p50_ms']):>7s}/{fmt_ms(t['pinned']['p99_ms']):<7s}"
              f" {fmt_ms(t['unpinned']['p50_ms']):>8s}/{fmt_ms(t['unpinned']['p99_ms']):<8s}"
              f" {'n/a' if unreach is None else unreach:>8} {r['wall_s']:7.1f}")
    print("(hit rates: shares of prompt tokens; unreach: unreachable_pages at the end, n/a: the server has no such figure)")
    for name, r in result["runs"].items():
        if r["reported"]:
            print(f"{name}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                        for k, v in sorted(r["reported"].items())))
        if r["pins_refused"]:
            print(f"{name}: {len(r['pins_refused'])} pins refused, first: {r['pins_refused'][0]}")
    if not any(r["reported"].get(k) is not None for r in result["runs"].values()
               for k in r["reported"] if k.startswith(DELTA_PREFIXES)):
        print("loads vs recomputes: the server reports no tier_load* / tier_recompute* figures yet")
    if not any(k.startswith("cost_") for r in result["runs"].values() for k in r["reported"]):
        print("measured costs: the server reports no cost_* figures yet")
    for name, why in result["skipped"].items():
        print(f"SKIPPED {name}: {why}")
    for name, note in result["notes"].items():
        print(f"NOTE {name}: {note}")


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = result["runs"]
    names = list(runs)
    x = range(len(names))
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    bottom = [0.0] * len(names)
    for tier in ("device", "host", "disk"):
        vals = [runs[n]["hit_rate"][tier] for n in names]
        a.bar(x, vals, bottom=bottom, label=tier)
        bottom = [u + v for u, v in zip(bottom, vals)]
    a.set_ylim(0, 1)
    a.set_ylabel("share of prompt tokens cached")
    a.set_title("hit rate by tier")
    a.legend()
    b.bar(x, [runs[n]["tok_s_vs_off"] for n in names], color="tab:green")
    b.axhline(1.0, color="grey", ls=":")
    b.set_ylabel("tokens/s vs tiers off")
    b.set_title("throughput")
    w = 0.2
    for i, (group, q) in enumerate((("pinned", "p50_ms"), ("pinned", "p99_ms"), ("unpinned", "p50_ms"), ("unpinned", "p99_ms"))):
        c.bar([j + (i - 1.5) * w for j in x], [runs[n]["ttft"][group][q] or 0 for n in names], w, label=f"{group} {q[:3]}")
    c.set_ylabel("TTFT ms")
    c.set_title("TTFT, pinned vs unpinned prefixes" + ("" if result["sizing"]["pins"] else " (pins not sent)"))
    c.legend(fontsize=8)
    for ax in (a, b, c):
        ax.set_xticks(list(x), names, rotation=20)
    fig.suptitle(f"kv_tiers on {result['model']}: {result['trace']['requests']} requests, device pool 1/4 of the working set, host 1/2, disk unbounded")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# -- main --------------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "100m"), default="tiny", help="llama-tiny (float32) or llama-100m (bfloat16)")
    p.add_argument("--quick", action="store_true", help="120 requests; off and the eviction policies only (~30 s)")
    p.add_argument("--requests", type=int, help="trace requests (default 360, --quick 120)")
    p.add_argument("--seed", type=int, default=TraceSpec.seed)
    p.add_argument("--trace", type=Path, help="a JSONL trace (scripts/gen_tenant_trace.py's format) instead of generating one")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    p.add_argument("--threads", type=int, default=1, help="torch threads (OMP_NUM_THREADS, inherited by the engines)")
    p.add_argument("--runs", help="comma-separated subset of run names (off, lru, lfu, cost, lru+write_back, ...)")
    p.add_argument("--rounds", type=int, default=1, help="times each run goes, interleaved (the median tok/s round is shown)")
    return p.parse_args()


def page_bytes(model: Path) -> int:
    import torch
    from radixrt.kernels import PagedKVCache

    from radixrt.models import ModelConfig

    cfg = ModelConfig.from_dir(model)
    dtype = getattr(torch, DTYPES[model.name])
    return PAGE * PagedKVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, dtype, "auto")


def sizing_for(model: Path, trace: list[dict], concurrency: int) -> dict[str, Any]:
    ws = working_set_pages(trace, PAGE)
    device = math.ceil(ws / 4)
    longest = max(math.ceil((len(r["input_ids"]) + r["max_new_tokens"]) / PAGE) for r in trace)
    if concurrency * longest > device:
        print(f"NOTE: {concurrency} of the longest request ({longest} pages) exceed the device pool ({device} pages): "
              "expect retractions")
    pb = page_bytes(model)
    return {"working_set_pages": ws, "device_pages": device, "page_bytes": pb, "longest_request_pages": longest,
            "disk_gb": 2 * ws * pb / 2**30, "pins": pins_supported()}


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported; read by the spawned engines
    model = ensure_model("llama", args.size)
    spec = TraceSpec(seed=args.seed, requests=args.requests or (120 if args.quick else 360))
    trace = read_jsonl(args.trace) if args.trace else make_trace(spec)
    sizing = sizing_for(model, trace, args.concurrency)
    configs = run_configs(args.quick)
    if args.runs:
        wanted = args.runs.split(",")
        configs = [c for c in configs if c.name in wanted]
    print(f"== {model.name} ({DTYPES[model.name]}), page size {PAGE}, {args.threads} torch thread(s); runs: {[c.name for c in configs]}")
    print("NOTE: the machine may be shared with other jobs: timings are noisy, read ratios within this run")
    result: dict[str, Any] = {"model": model.name, "trace": summary(trace, PAGE), "trace_spec": None if args.trace else dataclasses.asdict(spec),
                              "sizing": sizing, "concurrency": args.concurrency, "threads": args.threads,
                              "runs": {}, "skipped": {}, "notes": {}, "server_args": {}}
    ready = []
    for cfg in configs:
        run, why = resolve(model, cfg)
        if run is None:
            result["skipped"][cfg.name] = why
            print(f"SKIPPED {cfg.name}: {why}")
            continue
        if why:
            result["notes"][cfg.name] = why
        ready.append(run)
        result["server_args"][cfg.name] = {**run.server, "tiers": run.tiers}
    rounds: dict[str, list[dict]] = {cfg.name: [] for cfg in ready}
    for i in range(args.rounds):  # interleaved: a change in the machine's load hits every run alike
        for cfg in ready:
            print(f"running {cfg.name} (round {i + 1}/{args.rounds}) ...", flush=True)
            rounds[cfg.name].append(run_one(model, cfg, trace, args, sizing))
    for name, rs in rounds.items():
        median = sorted(rs, key=lambda r: r["tok_s"])[(len(rs) - 1) // 2]
        result["runs"][name] = {**median, "tok_s_rounds": [r["tok_s"] for r in rs]}
    off = result["runs"].get("off")
    for r in result["runs"].values():
        r["tok_s_vs_off"] = r["tok_s"] / off["tok_s"] if off else math.nan
        r["req_s_vs_off"] = r["req_s"] / off["req_s"] if off else math.nan
    print_table(result)
    print("\nwrote", write_result("kv_tiers", result))
    plot(result, RESULTS / "kv_tiers.png")
    print("wrote", RESULTS / "kv_tiers.png")


if __name__ == "__main__":
    main()

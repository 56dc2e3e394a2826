"""KV memory: what the quantized pool, the host/disk tiers and swap preemption buy, in one run.

1. capacity   One pool byte budget (what kv_cache_dtype=auto needs for --pool-tokens tokens);
              for each kv_cache_dtype the pool gets budget // bytes_per_token tokens (bytes per
              token from PagedKVCache.bytes_per_token, checked against the engine's
              get_server_info). --requests distinct prompts of --prompt-len tokens, --max-new
              output tokens (greedy, ignore_eos), submitted at once with the radix cache off,
              --rounds times per engine (output tokens/s: the median round).
              Concurrency is observed from outside: a thread polls get_server_info()["running"]
              every 20 ms (the scheduler answers between steps, so this samples once per step
              at most and can miss a one-step peak). Ratios are against auto.
2. cycling    tests/support/workloads.py cycling_documents: more documents than the device pool holds,
              document by document, every other pass backwards (as tests/test_kv_tiers.py
              run_documents does). Same small device pool, radix cache on, under: off (no
              tiers), host (hierarchical cache, a host tier that holds every document) and
              host+disk (a host tier of one device pool, the rest on disk in a temp dir).
              Each request is streamed with async_generate(stream=True); TTFT is submission to
              the first chunk with a token. Throughput counts prompt + output tokens.
3. swap       Per retracted request of L tokens, in this process on one ModelRunner:
              recompute = the prefill step of L tokens (the scheduler builds the batch, as
              bench/gpu_decode.py does); "marginal" subtracts a 1-token step, which is closer to
              what recompute adds to a step that runs anyway (a recomputed request is prefilled
              alongside the others' decodes). swap = KVTierStore.run([d2h of ceil(L/16) pages])
              + run([h2d back]) on the runner's own cache. Crossover: the smallest measured L
              from which swap stays cheaper than the marginal recompute (the figure for
              --swap-min-tokens). Plot: bench/results/kv_memory_swap.png.

Torch runs --threads intra-op threads (OMP_NUM_THREADS, inherited by the engines' processes),
1 by default, for steady timings on the shared 2-vCPU machine (see bench/prefix_reuse.py).
NOTE: on CPU, "device" and "host" are the same RAM, so d2h/h2d are memcpys; on a GPU they
cross PCIe and the crossover moves. Results merge per model into bench/results/kv_memory.json.

    .venv/bin/python bench/kv_memory.py [--size tiny|100m] [--parts capacity,cycling,swap]
    .venv/bin/python bench/kv_memory.py --parts swap --device cuda --size 100m   # swap on a GPU
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from common import RESULTS, ROOT, Poller, TimedWorker, ensure_model, random_prompts, write_result

sys.path.insert(0, str(ROOT / "tests"))
from support.helpers import corpus_ids
from support.workloads import cycling_documents

PAGE = 16
KV_DTYPES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8")
POLL_S = 0.02


def engine_args(path: Path, dtype: str, **kw: Any) -> dict[str, Any]:
    return dict(model_path=str(path), dtype=dtype, page_size=PAGE, log_level="warning", **kw)


def delta(before: dict, after: dict, keys: tuple[str, ...]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in keys}


# -- 1. KV dtype capacity ------------------------------------------------------------------


def kv_bytes_per_token(path: Path, dtype: str, kv_dtype: str) -> int:
    import torch
    from radixrt.kernels import PagedKVCache

    from radixrt.models import ModelConfig

    cfg = ModelConfig.from_dir(path)
    return PagedKVCache.bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, getattr(torch, dtype), kv_dtype)


def run_round(engine: Any, prompts: list[list[int]], sampling: dict[str, Any]) -> tuple[float, int]:
    """(wall seconds, output tokens) of every prompt submitted at once."""
    start = time.perf_counter()
    out = asyncio.run(engine.async_generate(input_ids=prompts, sampling_params=sampling))
    return time.perf_counter() - start, sum(o["meta_info"]["completion_tokens"] for o in out)


def run_capacity(path: Path, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    import radixrt

    budget = args.pool_tokens * kv_bytes_per_token(path, dtype, "auto")
    prompts = random_prompts(args.requests, args.prompt_len, args.prompt_len, vocab=1000, seed=1)
    sampling = {"max_new_tokens": args.max_new, "temperature": 0, "ignore_eos": True}
    rows = {}
    for kv in KV_DTYPES:
        bpt = kv_bytes_per_token(path, dtype, kv)
        # random weights: fp8's start-up agreement is below the default floor (tests/test_kv_quant.py)
        with radixrt.Engine(**engine_args(path, dtype, kv_cache_dtype=kv, kv_quant_min_agreement=0.0,
                                          max_total_tokens=budget // bpt, disable_radix_cache=True)) as engine:
            engine.generate(input_ids=[list(range(3, 40))], sampling_params={"max_new_tokens": 4})  # warm-up
            before = engine.get_server_info()
            assert before["bytes_per_token"] == bpt, (kv, before["bytes_per_token"], bpt)
            with Poller(engine.get_server_info, "running", POLL_S) as peak:
                rounds = [run_round(engine, prompts, sampling) for _ in range(args.rounds)]
            after = engine.get_server_info()
        tok_s = sorted(n / wall for wall, n in rounds)
        rows[kv] = {"pool_tokens": before["num_pages"] * PAGE, "bytes_per_token": bpt,
                    "pool_bytes": before["num_pages"] * PAGE * bpt, "max_running": peak.peak, "polls": peak.samples,
                    "output_tok_s": statistics.median(tok_s), "output_tok_s_min": tok_s[0], "output_tok_s_max": tok_s[-1],
                    "all_completed": all(n == args.requests * args.max_new for _, n in rounds),
                    **delta(before, after, ("retractions", "recomputed_tokens"))}
    auto = rows["auto"]
    for r in rows.values():
        r.update(tokens_vs_auto=r["pool_tokens"] / auto["pool_tokens"], running_vs_auto=r["max_running"] / auto["max_running"],
                 tok_s_vs_auto=r["output_tok_s"] / auto["output_tok_s"])
    return {"budget_bytes": budget, "requests": args.requests, "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new, "rounds": args.rounds, "concurrency_source": "get_server_info()['running'] polled every 20 ms",
            "dtypes": rows}


def print_capacity(c: dict[str, Any]) -> None:
    print(f"\n-- 1. KV dtype capacity: pool budget {c['budget_bytes'] / 2**20:.2f} MiB; {c['requests']} requests x "
          f"{c['prompt_len']} prompt + {c['max_new_tokens']} output tokens, all at once, radix cache off; median of "
          f"{c['rounds']} rounds")
    print(f"{'kv dtype':9s} {'pool tok':>9s} {'B/token':>8s} {'max run':>8s} {'polls':>6s} {'out tok/s':>10s} {'(min-max)':>11s} {'retract':>8s}"
          f" {'tokens vs auto':>15s} {'running vs auto':>16s} {'tok/s vs auto':>14s}")
    for kv, r in c["dtypes"].items():
        print(f"{kv:9s} {r['pool_tokens']:9d} {r['bytes_per_token']:8d} {r['max_running']:8d} {r['polls']:6d}"
              f" {r['output_tok_s']:10.0f} {r['output_tok_s_min']:5.0f}-{r['output_tok_s_max']:<5.0f} {r['retractions']:8d} {r['tokens_vs_auto']:14.2f}x {r['running_vs_auto']:15.2f}x"
              f" {r['tok_s_vs_auto']:13.2f}x")
    if not all(r["all_completed"] for r in c["dtypes"].values()):
        print("!! some requests did not produce all their output tokens")


# -- 2. cycling documents through the tiers ------------------------------------------------


async def stream_one(engine: Any, ids: list[int], sampling: dict[str, Any]) -> tuple[float, int]:
    """(TTFT seconds, prompt + completion tokens) of one streamed request."""
    start, first, last = time.perf_counter(), None, None
    async for chunk in await engine.async_generate(input_ids=ids, sampling_params=sampling, stream=True):
        if first is None and chunk["output_ids"]:
            first = time.perf_counter()
        last = chunk
    return first - start, last["meta_info"]["prompt_tokens"] + last["meta_info"]["completion_tokens"]


async def run_passes(engine: Any, groups: list[list[list[int]]], passes: int, sampling: dict) -> list[list[tuple[float, int]]]:
    """Per pass, (ttft, tokens) per request: document by document, every other pass backwards."""
    out = []
    for p in range(passes):
        done = []
        for prompts in groups if p % 2 == 0 else groups[::-1]:
            done += await asyncio.gather(*(stream_one(engine, ids, sampling) for ids in prompts))
        out.append(done)
    return out


TIER_KEYS = ("prompt_tokens", "cached_prompt_tokens", "host_hit_pages", "disk_hit_pages", "pages_d2h", "pages_h2d",
             "pages_h2disk", "pages_disk2d", "evicted_pages", "tier_move_seconds")


def run_tier_config(path: Path, dtype: str, groups: list, args: argparse.Namespace, tiers: dict) -> dict[str, Any]:
    import radixrt

    sampling = {"max_new_tokens": args.doc_max_new, "temperature": 0, "ignore_eos": True}
    with radixrt.Engine(**engine_args(path, dtype, max_total_tokens=args.doc_pool, **tiers)) as engine:
        engine.generate(input_ids=[list(range(3, 40))], sampling_params={"max_new_tokens": 4})  # warm-up
        engine.flush_cache()
        before = engine.get_server_info()
        start = time.perf_counter()
        passes = asyncio.run(run_passes(engine, groups, args.passes, sampling))
        wall = time.perf_counter() - start
        after = engine.get_server_info()
    d = delta(before, after, TIER_KEYS)
    ttft = [t for p in passes for t, _ in p]
    warm = [t for p in passes[1:] for t, _ in p]
    return {"wall_s": wall, "tok_s": sum(n for p in passes for _, n in p) / wall, "ttft_mean_s": statistics.fmean(ttft),
            "warm_ttft_mean_s": statistics.fmean(warm) if warm else None,
            "computed_prompt_tokens": d["prompt_tokens"] - d["cached_prompt_tokens"], **d}


def run_cycling(path: Path, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    groups = cycling_documents(corpus_ids(path), args.docs, args.doc_len, args.questions)
    doc_pages = args.docs * math.ceil(args.doc_len / PAGE)
    host_all = math.ceil(1.5 * doc_pages / (args.doc_pool // PAGE))  # host ratio that holds every document
    with tempfile.TemporaryDirectory(prefix="kv_memory_disk_") as disk:
        configs = {
            "off": {},
            "host": {"enable_hierarchical_cache": True, "hicache_ratio": float(host_all)},
            "host+disk": {"enable_hierarchical_cache": True, "hicache_ratio": 1.0, "hicache_dir": disk,
                          "hicache_disk_size": 0.25},
        }
        runs = {name: run_tier_config(path, dtype, groups, args, tiers) for name, tiers in configs.items()}
    off = runs["off"]
    for r in runs.values():
        r.update(tok_s_vs_off=r["tok_s"] / off["tok_s"], ttft_gain_vs_off=off["ttft_mean_s"] / r["ttft_mean_s"],
                 warm_ttft_gain_vs_off=off["warm_ttft_mean_s"] / r["warm_ttft_mean_s"] if r["warm_ttft_mean_s"] else None,
                 computed_vs_off=r["computed_prompt_tokens"] / max(off["computed_prompt_tokens"], 1))
    return {"docs": args.docs, "doc_len": args.doc_len, "questions": args.questions, "passes": args.passes,
            "max_new_tokens": args.doc_max_new, "device_pool_tokens": args.doc_pool, "host_ratio_for_host": host_all,
            "ttft_source": "async_generate(stream=True) per request, submission to first chunk with a token",
            "configs": configs_for_json(configs), "runs": runs}


def configs_for_json(configs: dict[str, dict]) -> dict[str, dict]:
    return {n: {k: ("<tmp dir>" if k == "hicache_dir" else v) for k, v in c.items()} for n, c in configs.items()}


def print_cycling(c: dict[str, Any]) -> None:
    print(f"\n-- 2. cycling documents: {c['docs']} documents of {c['doc_len']} tokens x {c['questions']} questions, "
          f"{c['passes']} passes (alternating direction), {c['max_new_tokens']} output tokens; device pool "
          f"{c['device_pool_tokens']} tokens; TTFT from streamed async_generate")
    print(f"{'config':10s} {'tok/s':>7s} {'vs off':>7s} {'TTFT mean':>10s} {'gain':>6s} {'warm TTFT':>10s} {'gain':>6s}"
          f" {'computed':>9s} {'vs off':>7s} {'host hit':>9s} {'disk hit':>9s} {'d2h':>5s} {'h2disk':>6s} {'move s':>7s} {'wall s':>7s}")
    for name, r in c["runs"].items():
        print(f"{name:10s} {r['tok_s']:7.0f} {r['tok_s_vs_off']:6.2f}x {r['ttft_mean_s'] * 1e3:8.1f}ms {r['ttft_gain_vs_off']:5.2f}x"
              f" {r['warm_ttft_mean_s'] * 1e3:8.1f}ms {r['warm_ttft_gain_vs_off']:5.2f}x {r['computed_prompt_tokens']:9d}"
              f" {r['computed_vs_off']:6.2f}x {r['host_hit_pages']:9d} {r['disk_hit_pages']:9d} {r['pages_d2h']:5d}"
              f" {r['pages_h2disk']:6d} {r['tier_move_seconds']:7.3f} {r['wall_s']:7.2f}")
    print("(gain: off's mean TTFT / this one's; warm: passes after the first; computed: prompt - cached prompt tokens)")


# -- 3. swap vs recompute per retracted request ----------------------------------------------


def prefill_step(runner: Any, sched: Any, n: int) -> float:
    """Seconds of the one forward that prefills a fresh n-token prompt (max_new_tokens 1: it finishes there)."""
    from radixrt.messages import TokenizedRequest
    from radixrt.sampling_params import SamplingParams
    from radixrt.scheduler.step import step

    i = sched.admissions  # distinct per request: a new prompt and id each time
    prompt = random_prompts(1, n, n, vocab=1000, seed=i)[0]
    sched.add_request(TokenizedRequest(f"r{i}", prompt, SamplingParams(max_new_tokens=1, temperature=0)))
    timed = TimedWorker(runner)
    step(sched, timed)
    assert sched.idle and len(timed.steps) == 1, "the prefill took more than one step"
    return timed.steps[0][1]


def move_time(store: Any, kind: str, pages: list[int], reps: int) -> float:
    """Median seconds of one KVTierStore.run of a single move of these pages (device page i <-> host page i)."""
    from radixrt.messages import KVMove

    times = []
    for _ in range(reps):
        start = time.perf_counter()
        store.run([KVMove(kind, pages, pages)])  # run() synchronizes a CUDA device before returning
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_swap(path: Path, dtype: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from radixrt.config import ServerArgs
    from radixrt.config_views import SchedulerConfig
    from radixrt.scheduler.scheduler import Scheduler
    from radixrt.worker.kv_tiers import KVTierStore
    from radixrt.worker.model_runner import ModelRunner

    torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    server = ServerArgs(model_path=str(path), dtype=dtype, device=args.device, page_size=PAGE, max_running_requests=4,
                        max_total_tokens=(max(lengths) // PAGE + 2) * PAGE, chunked_prefill_size=max(lengths),
                        disable_radix_cache=True, disable_cuda_graph=True, log_level="warning")
    runner = ModelRunner(server)
    sched = Scheduler(SchedulerConfig.of(server), runner.ready_message(), tokenizer=None)
    store = KVTierStore(runner.cache, math.ceil(max(lengths) / PAGE), None, 0, rank=0)
    for n in (1, max(lengths)):  # warm-up: allocator and kernels
        prefill_step(runner, sched, n)
    move_time(store, "d2h", list(range(store.host_pages)), 1)  # the host pages' first touch
    rows = {}
    for n in lengths:
        pages = list(range(math.ceil(n / PAGE)))
        reps = max(3, args.reps if n <= 512 else args.reps // 2)
        # the 1-token step alternates with the L-token one, so a change in the machine's load hits both
        pairs = [(prefill_step(runner, sched, 1), prefill_step(runner, sched, n)) for _ in range(reps)]
        one, recompute = (statistics.median(t) for t in zip(*pairs))
        d2h, h2d = move_time(store, "d2h", pages, reps), move_time(store, "h2d", pages, reps)
        rows[n] = {"pages": len(pages), "recompute_s": recompute, "one_token_step_s": one,
                   "recompute_marginal_s": max(recompute - one, 0.0), "d2h_s": d2h, "h2d_s": h2d, "swap_s": d2h + h2d}
    one_token = statistics.median(r["one_token_step_s"] for r in rows.values())
    return {"device": str(runner.device), "one_token_step_s": one_token, "page_bytes": runner.bytes_per_token * PAGE,
            "rows": rows, "crossover": crossover(rows, "recompute_marginal_s"),
            "crossover_whole_step": crossover(rows, "recompute_s")}


def crossover(rows: dict[int, dict], key: str) -> dict[str, Any]:
    """The smallest measured L from which swap stays cheaper than recompute (by key), and the L
    where recompute - swap crosses 0, linearly interpolated between the last measured L where
    recompute won and that one (linear, not log-log: a marginal recompute can measure 0)."""
    lengths = sorted(rows)
    cheaper = [rows[n]["swap_s"] < rows[n][key] for n in lengths]
    tail = next((i for i in range(len(lengths)) if all(cheaper[i:])), None)
    if tail is None:
        return {"length": None, "estimate": None, "text": "recompute is cheaper at the largest measured L"}
    if tail == 0:
        return {"length": lengths[0], "estimate": None, "text": f"swap is cheaper at every measured L (from {lengths[0]})"}
    a, b = lengths[tail - 1], lengths[tail]
    ga, gb = (rows[n][key] - rows[n]["swap_s"] for n in (a, b))  # ga <= 0 < gb: swap is cheaper at b
    est = a + (b - a) * -ga / (gb - ga)
    mixed = " (not monotone below it)" if any(cheaper[:tail]) else ""
    return {"length": b, "estimate": round(est), "text": f"swap is cheaper from L = {b}{mixed}; interpolated {est:.0f}"}


def print_swap(s: dict[str, Any]) -> None:
    print(f"\n-- 3. swap vs recompute per retracted request, on {s['device']} (page {s['page_bytes'] / 1024:.1f} KiB;"
          f" a 1-token step takes {s['one_token_step_s'] * 1e3:.2f} ms; marginal = recompute - that step)")
    print(f"{'L':>6s} {'pages':>6s} {'recompute':>10s} {'marginal':>10s} {'d2h':>9s} {'h2d':>9s} {'swap':>9s}"
          f" {'recompute/swap':>15s} {'marginal/swap':>14s}")
    for n, r in s["rows"].items():
        print(f"{n:6d} {r['pages']:6d} {r['recompute_s'] * 1e3:8.2f}ms {r['recompute_marginal_s'] * 1e3:8.2f}ms"
              f" {r['d2h_s'] * 1e3:7.3f}ms {r['h2d_s'] * 1e3:7.3f}ms {r['swap_s'] * 1e3:7.3f}ms"
              f" {r['recompute_s'] / r['swap_s']:14.1f}x {r['recompute_marginal_s'] / r['swap_s']:13.1f}x")
    print(f"crossover (marginal recompute vs swap): {s['crossover']['text']}")
    print(f"crossover (whole prefill step vs swap): {s['crossover_whole_step']['text']}")


def plot_swap(models: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [(m, r["swap"]) for m, r in models.items() if "swap" in r]
    fig, axes = plt.subplots(1, len(runs), figsize=(6.5 * len(runs), 4.5), squeeze=False)
    for ax, (model, s) in zip(axes[0], runs):
        lengths = [int(n) for n in s["rows"]]
        for key, style, label in (("recompute_s", "o-", "recompute (whole prefill step)"),
                                  ("recompute_marginal_s", "o--", "recompute (marginal: minus a 1-token step)"),
                                  ("swap_s", "s-", "swap (d2h + h2d)")):
            ax.loglog(lengths, [max(r[key], 1e-6) * 1e3 for r in s["rows"].values()], style, label=label)
        c = s["crossover"]
        if c["estimate"] is not None:
            ax.axvline(c["estimate"], color="grey", ls=":", label=f"crossover ~{c['estimate']} tokens (interpolated)")
        elif c["length"] is not None:
            ax.axvline(c["length"], color="grey", ls=":", label=f"swap cheaper at every measured L (from {c['length']})")
        ax.set_xlabel("tokens in the retracted request (L)")
        ax.set_ylabel("ms per request")
        ax.set_title(f"llama-{model} on {s['device']}: swap vs recompute")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- main ------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=("tiny", "100m"), default="tiny", help="llama-tiny (float32) or llama-100m (bfloat16)")
    p.add_argument("--parts", default="capacity,cycling,swap", help="comma-separated subset of capacity,cycling,swap")
    p.add_argument("--threads", type=int, default=1, help="torch threads (OMP_NUM_THREADS, inherited by the engines)")
    p.add_argument("--pool-tokens", type=int, default=3072, help="(capacity) the byte budget is what auto needs for this many tokens")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="(capacity) times the batch runs per dtype (median tok/s)")
    p.add_argument("--docs", type=int, default=8, help="(cycling) documents in the cycle")
    p.add_argument("--doc-len", type=int, default=400)
    p.add_argument("--questions", type=int, default=4, help="(cycling) questions per document")
    p.add_argument("--passes", type=int, default=4)
    p.add_argument("--doc-max-new", type=int, default=16)
    p.add_argument("--doc-pool", type=int, default=1024, help="(cycling) device pool tokens (about 2.5 documents)")
    p.add_argument("--lengths", default="16,64,256,1024,2048", help="(swap) retracted request lengths L")
    p.add_argument("--reps", type=int, default=15, help="(swap) timings per point (median; half for L > 512)")
    p.add_argument("--device", default="cpu", help="(swap) the ModelRunner's device (parts 1-2 use the engine's default)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # before torch is imported; read by the spawned engines
    parts = set(args.parts.split(","))
    path = ensure_model("llama", args.size)
    dtype = "float32" if args.size == "tiny" else "bfloat16"
    print(f"== llama-{args.size} ({dtype}), page size {PAGE}, {args.threads} torch thread(s); parts: {args.parts}")
    print("NOTE: the machine is shared with other jobs: timings are noisy, ratios within a part are the figure to read")
    result: dict[str, Any] = {"dtype": dtype, "threads": args.threads}
    if "capacity" in parts:
        result["capacity"] = run_capacity(path, dtype, args)
        print_capacity(result["capacity"])
    if "cycling" in parts:
        result["cycling"] = run_cycling(path, dtype, args)
        print_cycling(result["cycling"])
    if "swap" in parts:
        result["swap"] = run_swap(path, dtype, args)
        print_swap(result["swap"])
    key = args.size if args.device == "cpu" else f"{args.size}-{args.device}"
    path_json = RESULTS / "kv_memory.json"
    models = json.loads(path_json.read_text()).get("models", {}) if path_json.exists() else {}
    models[key] = {**models.get(key, {}), **result}  # a --parts run keeps the other parts' last figures
    print("\nwrote", write_result("kv_memory", {"models": models}))
    if any("swap" in m for m in models.values()):
        plot_swap(models, RESULTS / "kv_memory_swap.png")
        print("wrote", RESULTS / "kv_memory_swap.png")


if __name__ == "__main__":
    main()

"""Speculative decoding (n-gram drafts) against none: the same server with and without
`--speculative-algorithm NGRAM --speculative-num-draft-tokens 8`, in one run on one machine.

Workloads (bench/spec_workloads.py; seeded, chat template applied client-side, prompts sent as
token ids; greedy, ignore_eos, so both servers generate the same number of tokens):
  doc_qa, code_edit  copy-heavy: quote sentences of a document / rewrite code with one rename
  multiturn          chats whose every turn resends the conversation so far
  unique             the peers' W2_unique (unrelated stdlib text): little for n-grams to find

Each workload runs closed-loop at each concurrency b (b requests in flight; max(waves * b, 8) requests (--waves, 2),
max(b, 4) with --quick; multiturn: b chats at a time, max(b, ceil(requests / turns)) chats, the
turns of a chat in order). Client-side, per request: TTFT = submission -> first chunk with a
token; TPOT = (last chunk - first) / (tokens - 1). Output tok/s = completion tokens / wall time
of the point. From meta_info: accept length = completion tokens per verify step (the requests'
spec_accept_length weighted by their spec_verify_ct), accept rate = accepted / proposed draft
tokens (spec_accept_rate weighted the same way). "same" counts requests whose greedy output is
identical with and without speculation (first repeat; multiturn prompts depend on earlier replies).

One Engine per mode and repeat, never two at once; the cache is flushed before every point.
Repeats interleave the modes (off, on / on, off / ...) and each figure is the median over repeats.
Until the runtime takes the speculative flags, the baseline half runs, its figures are written,
and the run ends with an error saying so. Pass line (printed, the exit status ignores it): the
ratio > 1 at b=1 on doc_qa and code_edit, and >= 0.95 everywhere. Results merge per model into
bench/results/speculative.json (with the host's CPU and flags); plots in speculative.png.

    .venv/bin/python bench/speculative.py                      # smollm2, 3 repeats
    .venv/bin/python bench/speculative.py --quick --model-path ~/.cache/radixrt-peers/models/tiny
    .venv/bin/python bench/speculative.py --breadth 1,10       # NGRAM draft trees (SGLang's default breadth)
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import save_model_result
from peaks import host
from spec_plot import plot
from spec_workloads import Template, Workload, build

MODELS = Path("~/.cache/radixrt-peers/models").expanduser()
PAGE = 16
MAX_NEW = {"doc_qa": 128, "code_edit": 128, "multiturn": 96, "unique": 64}
WORKLOADS = tuple(MAX_NEW)
COPY_HEAVY = ("doc_qa", "code_edit")
MODES = ("off", "on")
WARMUP = [list(range(20, 80)), list(range(100, 140))]


@dataclass(frozen=True)
class Done:
    """One request as the client saw it (times in seconds)."""

    output_ids: list[int]
    ttft: float
    tpot: float | None
    meta: dict[str, Any]


# -- the client -----------------------------------------------------------------------------------


async def stream_one(engine: Any, ids: list[int], max_new: int) -> Done:
    params = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
    start, first, last = time.perf_counter(), None, None
    async for chunk in await engine.async_generate(input_ids=ids, sampling_params=params, stream=True):
        if first is None and chunk["output_ids"]:
            first = time.perf_counter()
        last = chunk
    end, out = time.perf_counter(), list(last["output_ids"])
    tpot = (end - first) / (len(out) - 1) if len(out) > 1 else None
    return Done(out, first - start, tpot, last["meta_info"])


async def in_flight(jobs: list[Callable[[], Awaitable[list[Done]]]], width: int) -> list[Done]:
    """Run jobs with at most `width` at a time; their results concatenated in job order."""
    results: list[list[Done]] = [[] for _ in jobs]
    queue = iter(enumerate(jobs))

    async def worker() -> None:
        for i, job in queue:
            results[i] = await job()

    await asyncio.gather(*(worker() for _ in range(width)))
    return [d for r in results for d in r]


async def chat(engine: Any, template: Template, asks: tuple[str, ...], max_new: int) -> list[Done]:
    messages: list[dict[str, str]] = []
    done: list[Done] = []
    for ask in asks:
        messages.append({"role": "user", "content": ask})
        done.append(await stream_one(engine, template.ids(messages), max_new))
        messages.append({"role": "assistant", "content": template.reply(done[-1].output_ids)})
    return done


def jobs_for(engine: Any, template: Template, wl: Workload, n: int, batch: int) -> list[Callable[[], Awaitable[list[Done]]]]:
    if wl.is_chat:
        chats = wl.chats[: max(batch, -(-n // len(wl.chats[0])))]
        return [lambda c=c: chat(engine, template, c, wl.max_new) for c in chats]

    async def one(p: tuple[int, ...]) -> list[Done]:
        return [await stream_one(engine, list(p), wl.max_new)]

    return [lambda p=p: one(p) for p in wl.prompts[:n]]


def run_point(engine: Any, template: Template, wl: Workload, n: int, batch: int) -> tuple[dict[str, Any], list[list[int]]]:
    """One workload at one concurrency on a flushed cache: its figures and the outputs in order."""
    engine.flush_cache()
    start = time.perf_counter()
    done = asyncio.run(in_flight(jobs_for(engine, template, wl, n, batch), batch))
    return summarize(done, time.perf_counter() - start), [d.output_ids for d in done]


def summarize(done: list[Done], wall: float) -> dict[str, Any]:
    tokens = sum(len(d.output_ids) for d in done)
    verify = [d.meta.get("spec_verify_ct") or 0 for d in done]
    steps = sum(verify)

    def weighted(key: str) -> float | None:
        if not steps or any(d.meta.get(key) is None for d in done):
            return None
        return sum(d.meta[key] * v for d, v in zip(done, verify)) / steps

    return {
        "requests": len(done), "output_tokens": tokens, "wall_s": wall, "output_tok_s": tokens / wall,
        "ttft_p50_s": statistics.median(d.ttft for d in done),
        "tpot_p50_s": statistics.median([d.tpot for d in done if d.tpot is not None] or [0.0]),
        "verify_steps": steps or None, "accept_length": weighted("spec_accept_length"),
        "accept_rate": weighted("spec_accept_rate"),
    }


# -- one server, one sweep --------------------------------------------------------------------------


def engine_kwargs(model: Path, pool_tokens: int, spec: dict[str, Any] | None) -> dict[str, Any]:
    return dict(model_path=str(model), page_size=PAGE, max_total_tokens=pool_tokens, log_level="warning", **(spec or {}))


def spec_refused(model: Path, spec: dict[str, Any]) -> str | None:
    """Why ServerArgs does not take the speculative flags, or None (checked without starting anything)."""
    from radixrt.config import ServerArgs

    try:
        ServerArgs.from_kwargs(**engine_kwargs(model, 1 << 16, spec))
    except (ValueError, TypeError) as e:
        return str(e)
    return None


def sweep(kwargs: dict[str, Any], template: Template, wls: dict[str, Workload], sizes: dict[int, int],
          mode: str) -> tuple[dict, dict]:
    """Every workload at every concurrency in one fresh Engine: figures[wl][b], outputs[wl][b]."""
    import radixrt

    figures: dict[str, dict[int, dict]] = {w: {} for w in wls}
    outputs: dict[str, dict[int, list]] = {w: {} for w in wls}
    with radixrt.Engine(**kwargs) as engine:
        engine.generate(input_ids=WARMUP, sampling_params={"max_new_tokens": 8, "temperature": 0})  # not timed
        for name, wl in wls.items():
            for b, n in sizes.items():
                figures[name][b], outputs[name][b] = run_point(engine, template, wl, n, b)
                f = figures[name][b]
                print(f"  {mode:3s} {name:9s} b={b:<3d} {f['output_tok_s']:8.1f} tok/s  {f['requests']:4d} req"
                      f"  {f['wall_s']:6.1f} s  accept length {fmt(f['accept_length'], '.2f')}", flush=True)
    return figures, outputs


# -- the report -------------------------------------------------------------------------------------


def fmt(v: float | None, spec: str, scale: float = 1.0) -> str:
    """v * scale formatted by spec, "-" for a figure that does not exist (the speculative half's
    without it); pad the result with the caller's width."""
    return "-" if v is None else format(v * scale, spec)


def median_of(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def rows_of(runs: dict, outputs: dict, wls: dict[str, Workload], sizes: dict[int, int]) -> dict[str, dict[int, dict]]:
    rows: dict[str, dict[int, dict]] = {}
    for w in wls:
        rows[w] = {}
        for b in sizes:
            off, on = runs["off"][w][b], runs["on"][w][b]
            r = {f"{k}_{m}": median_of(rs, k) for m, rs in (("off", off), ("on", on))
                 for k in ("output_tok_s", "ttft_p50_s", "tpot_p50_s")}
            r.update(accept_length=median_of(on, "accept_length"), accept_rate=median_of(on, "accept_rate"))
            r["ratio"] = r["output_tok_s_on"] / r["output_tok_s_off"] if r["output_tok_s_on"] else None
            a, c = outputs["off"].get((w, b)), outputs["on"].get((w, b))
            r["same_outputs"] = sum(x == y for x, y in zip(a, c)) if a and c else None
            r["requests"] = len(a) if a else None
            rows[w][b] = r
    return rows


def print_table(rows: dict[str, dict[int, dict]]) -> None:
    print(f"\n{'workload':9s} {'b':>3s} {'tok/s off':>9s} {'on':>8s} {'ratio':>6s} {'acc len':>7s} {'acc rate':>8s}"
          f" {'TTFT ms off/on':>15s} {'TPOT ms off/on':>15s} {'same':>7s}")
    for w, by_b in rows.items():
        for b, r in by_b.items():
            same = "-" if r["same_outputs"] is None else f"{r['same_outputs']}/{r['requests']}"
            tok = f"{fmt(r['output_tok_s_off'], '.1f'):>9s} {fmt(r['output_tok_s_on'], '.1f'):>8s} {fmt(r['ratio'], '.2f'):>5s}x"
            acc = f"{fmt(r['accept_length'], '.2f'):>7s} {fmt(r['accept_rate'], '.1%'):>8s}"
            ttft = f"{fmt(r['ttft_p50_s_off'], '.0f', 1e3):>7s}/{fmt(r['ttft_p50_s_on'], '.0f', 1e3):<7s}"
            tpot = f"{fmt(r['tpot_p50_s_off'], '.1f', 1e3):>7s}/{fmt(r['tpot_p50_s_on'], '.1f', 1e3):<7s}"
            print(f"{w:9s} {b:3d} {tok} {acc} {ttft} {tpot} {same:>7s}")


def verdict(rows: dict[str, dict[int, dict]], refused: str | None) -> dict[str, Any]:
    if refused:
        return {"pass": None, "line": f"VERDICT: not measured, the speculative half did not run ({refused})"}
    misses = [f"{w} b={b} {r['ratio']:.2f}x" for w, by_b in rows.items() for b, r in by_b.items()
              if r["ratio"] is not None and r["ratio"] < 0.95]
    misses += [f"{w} b=1 {rows[w][1]['ratio']:.2f}x (must win)" for w in COPY_HEAVY
               if w in rows and 1 in rows[w] and rows[w][1]["ratio"] is not None and rows[w][1]["ratio"] <= 1.0]
    ok = not misses
    return {"pass": ok, "misses": misses, "line": "VERDICT: " + ("PASS: speculation wins at b=1 on the copy-heavy"
            " workloads and loses by no more than 5% anywhere" if ok else "FAIL: " + "; ".join(misses))}


# -- main ----------------------------------------------------------------------------------------


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", type=Path, default=MODELS / "smollm2", help="a HF checkpoint directory (tiny: a quick run)")
    p.add_argument("--quick", action="store_true", help="fewer requests, 1 repeat")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (the median is reported)")
    p.add_argument("--batches", default="1,4,16,64", help="concurrencies, comma-separated")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--turns", type=int, default=3, help="multiturn: turns per chat")
    p.add_argument("--waves", type=int, default=2, help="requests per point: max(waves * b, 8)")
    p.add_argument("--max-new", type=int, default=0, help="new tokens per request in every workload (0: each its own)")
    p.add_argument("--algorithm", default="NGRAM", help="--speculative-algorithm")
    p.add_argument("--draft-tokens", type=int, default=8, help="--speculative-num-draft-tokens")
    p.add_argument("--breadth", default="1,1", help="NGRAM draft trees: --speculative-ngram-min/max-bfs-breadth, MIN,MAX "
                   "(1,1: chains; results then go under the model's name + -tree<MIN>-<MAX>)")
    p.add_argument("--match-type", default="BFS", help="--speculative-ngram-match-type (trees: BFS or PROB)")
    a = p.parse_args()
    if a.quick:
        a.repeats = 1
    return a


def main() -> None:
    a = parse_args()
    model = a.model_path.expanduser()
    spec = {"speculative_algorithm": a.algorithm, "speculative_num_draft_tokens": a.draft_tokens}
    low, high = map(int, a.breadth.split(","))
    tree = f"-tree{low}-{high}{'' if a.match_type == 'BFS' else '-' + a.match_type}" if high > 1 else ""
    if tree:
        spec |= {"speculative_ngram_min_bfs_breadth": low, "speculative_ngram_max_bfs_breadth": high,
                 "speculative_ngram_match_type": a.match_type}
    sizes = {b: max(b, 4) if a.quick else max(a.waves * b, 8) for b in map(int, a.batches.split(","))}
    names = tuple(a.workloads.split(","))
    template = Template.load(model)
    chats = max(max(b, -(-n // a.turns)) for b, n in sizes.items())
    max_new = {w: a.max_new or n for w, n in MAX_NEW.items()}
    wls = build(model, template, max(sizes.values()), chats, a.turns, max_new, names)
    per_seq = max(w.longest_prompt(template) + w.max_new for w in wls.values()) + a.draft_tokens + 2 * PAGE
    pool = max(sizes) * per_seq
    refused = spec_refused(model, spec)
    print(f"== {model.name}: {spec}, concurrency -> requests {sizes}, {a.repeats} repeat(s), pool {pool} tokens")
    if refused:
        print(f"!! the speculative half cannot run: ServerArgs refuses {spec}: {refused}", flush=True)
    runs = {m: {w: {b: [] for b in sizes} for w in wls} for m in MODES}
    outputs: dict[str, dict] = {m: {} for m in MODES}
    for r in range(a.repeats):
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            if mode == "on" and refused:
                continue
            print(f"-- repeat {r + 1}/{a.repeats}, speculation {mode}", flush=True)
            try:
                figures, outs = sweep(engine_kwargs(model, pool, spec if mode == "on" else None), template, wls, sizes, mode)
            except Exception as e:
                if mode == "off":
                    raise
                refused = f"speculative run failed: {type(e).__name__}: {e}"
                print(f"!! {refused}", flush=True)
                continue
            for w in wls:
                for b in sizes:
                    runs[mode][w][b].append(figures[w][b])
                    outputs[mode].setdefault((w, b), outs[w][b])
    rows = rows_of(runs, outputs, wls, sizes)
    print_table(rows)
    v = verdict(rows, refused)
    print("\n" + v["line"])
    key = model.name + tree + ("-quick" if a.quick else "")
    save_model_result("speculative", key, {
        "model_path": str(model), "host": host(), "spec_args": spec, "repeats": a.repeats, "requests": sizes,
        "max_new_tokens": {w: max_new[w] for w in wls}, "about": {w: wl.about for w, wl in wls.items()},
        "pool_tokens": pool, "spec_error": refused, "verdict": v, "rows": rows, "runs": runs}, plot)
    if refused:
        sys.exit(f"speculative half did not run: {refused}")


if __name__ == "__main__":
    main()

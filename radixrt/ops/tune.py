"""`radixrt tune --model-path M --trace trace.jsonl`: replay real traffic against in-process
engines, one variable at a time away from a baseline (page size; radix cache on/off; KV dtype
auto/int8 with a precision check; preemption recompute/swap/auto under a memory cap), then
print a table, write a JSON and a PNG, and end with the recommended launch_server flags and why.

Every distinct configuration is one engine start, one at a time: 5 uncapped (the baseline is a
point of three sweeps) and 3 capped, or 2 where preemption auto acts as one mode on every request
of the trace (tune_plan.auto_acts_as).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from radixrt.cli_args import add_server_args, server_args_from
from radixrt.config import ServerArgs
from radixrt.engine import Engine
from radixrt.ops.recommend import Recommendation, Rules, carried_flags, recommend
from radixrt.ops.replay import ReplayError, RunResult, empty_cache, pool_runs, replay, warm_up
from radixrt.ops.trace import TraceError, TraceRequest, load_trace, quick_subset
from radixrt.ops.tune_metrics import Precision, compare_outputs, peak_concurrent_tokens, summarize
from radixrt.ops.tune_plan import (PREEMPTION_MODES, Point, auto_acts_as, capped_points, memory_cap, run_label,
                                   uncapped_points, unique_args)
from radixrt.ops.tune_report import Measured, check_plotting, plot, table, write_json

DEFAULT_OUT = "bench/results/tune"
MAY_FAIL = ("kv_cache_dtype", "preemption_mode")  # variables whose other values may fail to start (int8's check)
QUICK_REQUESTS, QUICK_OUTPUT_LEN, QUICK_POOL_TOKENS = 12, 32, 4096


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="radixrt tune", description=__doc__.split("\n\n")[0],
        epilog="The server flags (those of `radixrt launch_server`) set the baseline; tune's own default it to "
               "--page-size 16 and --log-level warning.")
    p.add_argument("--trace", required=True, help="JSONL trace: one {arrival, prompt|input_ids, output_len} per line")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"directory for tune.json and tune.png (default: {DEFAULT_OUT})")
    p.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply arrival times by this (0.5 replays twice as fast; default: 1.0)")
    p.add_argument("--quick", action="store_true",
                   help=f"the first {QUICK_REQUESTS} requests, at most {QUICK_OUTPUT_LEN} output tokens each, and a "
                        f"{QUICK_POOL_TOKENS}-token KV pool unless --max-total-tokens is given; every variable is "
                        "still walked")
    p.add_argument("--repeats", type=int, default=1,
                   help="replays of the trace per engine, the prefix cache emptied before each; percentiles pool "
                        "them (more samples, less noise, no more engine starts; default: 1)")
    p.add_argument("--mem-cap-tokens", type=int, default=None,
                   help="KV pool tokens for the preemption runs (default: about 1/3 of the peak KV tokens the "
                        "baseline run's requests needed at once, rounded to pages, and at least the longest sequence)")
    p.add_argument("--tolerance", type=float, default=Rules.tolerance,
                   help=f"relative differences below this are noise in the rules (default: {Rules.tolerance})")
    p.add_argument("--min-int8-match", type=float, default=Rules.min_int8_match,
                   help="int8 KV is recommended only if its greedy outputs' mean leading-token match with fp's is at "
                        f"least this (default: {Rules.min_int8_match})")
    p.add_argument("--min-cache-hit", type=float, default=Rules.min_cache_hit,
                   help="the radix cache is recommended off only if its hit rate is below this and off measured "
                        f"faster (default: {Rules.min_cache_hit})")
    p.add_argument("--no-plot", action="store_true", help="do not draw tune.png (no matplotlib needed)")
    add_server_args(p)
    p.set_defaults(page_size=16, log_level="warning")
    return p


def main(argv: list[str]) -> int:
    ns = build_parser().parse_args(argv)
    try:
        base = _baseline(ns)
        requests = load_trace(ns.trace)
    except (ValueError, TraceError) as e:
        print(f"radixrt tune: {e}", file=sys.stderr)
        return 2
    hint = None if ns.no_plot else check_plotting()
    if hint is not None:
        print(f"radixrt tune: {hint}", file=sys.stderr)
        return 2
    if ns.quick:
        requests = quick_subset(requests, QUICK_REQUESTS, QUICK_OUTPUT_LEN)
    try:
        walk = Routine(base, requests, ns.time_scale, ns.mem_cap_tokens, ns.repeats).walk()
    except (ReplayError, RuntimeError, ValueError) as e:  # ValueError: a model_path the Engine cannot use
        print(f"radixrt tune: {e}", file=sys.stderr)
        return 1
    rules = Rules(ns.tolerance, ns.min_int8_match, ns.min_cache_hit)
    rec = recommend(_sweeps(walk.rows), _int8_precision(walk.rows), base, rules, walk.not_started)
    rec = dataclasses.replace(rec, carried=tuple(carried_flags(server_args_from(ns))))  # the user's, not --quick's pool
    _report(ns, walk, rec, meta=_meta(ns, requests, walk))
    return 0


def _baseline(ns: argparse.Namespace) -> ServerArgs:
    base = server_args_from(ns)
    if ns.quick and base.max_total_tokens is None:
        base = dataclasses.replace(base, max_total_tokens=QUICK_POOL_TOKENS)
    if ns.time_scale <= 0:
        raise ValueError(f"--time-scale must be > 0, got {ns.time_scale}")
    if ns.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {ns.repeats}")
    if ns.mem_cap_tokens is not None:  # validated now, not after the uncapped runs
        dataclasses.replace(base, max_total_tokens=ns.mem_cap_tokens)
    return base


@dataclass(frozen=True)
class Walk:
    """What the routine measured."""

    rows: list[Measured]  # the runs, baseline first
    not_started: dict[tuple[str, Any], str]  # (variable, value) -> why its engine did not start
    cap: int  # max_total_tokens of the preemption runs
    auto_as: str | None  # the mode preemption auto acted as on every request, when its run was shared


class Routine:
    """The walk: the uncapped points (baseline first), then the memory cap from the baseline's
    run, then the capped points. One engine per distinct configuration, one at a time."""

    def __init__(self, base: ServerArgs, requests: list[TraceRequest], time_scale: float, cap: int | None,
                 repeats: int = 1) -> None:
        self.base, self.requests, self.time_scale, self.cap, self.repeats = base, requests, time_scale, cap, repeats

    def walk(self) -> Walk:
        """Raises what a failed start or run of the baseline or the fp reference raises."""
        points = uncapped_points(self.base)
        runs = sorted(unique_args(points), key=lambda a: a != self.base)
        bar = tqdm(total=len(runs) + len(PREEMPTION_MODES), desc="configurations", unit="config", position=0)
        try:
            rows, not_started = self._run_all(runs, points, bar)
            records = rows[0].run.records
            cap = self.cap or self._derive_cap(rows[0].run)
            auto_as = auto_acts_as(self.base, [r.prompt_tokens for r in records], [r.seq_len for r in records])
            capped = capped_points(self.base, cap, auto_as)
            bar.total = len(runs) + len(unique_args(capped))
            more, more_failed = self._run_all(unique_args(capped), capped, bar)
            return Walk(_with_precision(rows + more), {**not_started, **more_failed}, cap, auto_as)
        finally:
            bar.close()

    def _run_all(self, runs: list[ServerArgs], points: list[Point],
                 bar: tqdm) -> tuple[list[Measured], dict[tuple[str, Any], str]]:
        rows: list[Measured] = []
        not_started: dict[tuple[str, Any], str] = {}
        for args in runs:
            mine = tuple(p for p in points if p.args == args)
            label = run_label(mine, args == self.base)
            bar.set_postfix_str(label)
            try:
                run, start_s = self._measure(args, label)
            except RuntimeError as e:  # StartupError: e.g. an int8 pool its start-up check refused
                if _is_fp(mine) or any(p.variable not in MAY_FAIL for p in mine):  # the rules need these
                    raise
                not_started.update({(p.variable, p.value): str(e) for p in mine})
                tqdm.write(f"{label}: the engine did not start: {e}")
            else:
                rows.append(Measured(label, args, mine, run, summarize(run), None, start_s))
            bar.update()
        return rows, not_started

    def _measure(self, args: ServerArgs, label: str) -> tuple[RunResult, float]:
        # NOTE: engines start and stop in this (the main) thread, one at a time: the launcher's
        # children are tied to the thread that starts them, and a start overlapping the previous
        # engine's shutdown was seen to lose a child at start-up.
        t0 = time.perf_counter()
        with Engine(**dataclasses.asdict(args)) as engine:
            start_s = time.perf_counter() - t0
            warm_up(engine)
            runs = []
            with tqdm(total=len(self.requests) * self.repeats, desc=label, unit="req", position=1, leave=False) as bar:
                for i in range(self.repeats):
                    if i:
                        empty_cache(engine)
                    runs.append(replay(engine, self.requests, self.time_scale, bar.update))
            return pool_runs(runs), start_s

    def _derive_cap(self, baseline: RunResult) -> int:
        """From the baseline's records (repeats do not overlap in them: the peak is one replay's)."""
        largest = max(r.seq_len for r in baseline.records)
        return memory_cap(peak_concurrent_tokens(baseline.records), largest, self.base.page_size)


def _is_fp(points: tuple[Point, ...]) -> bool:
    return any(p.variable == "kv_cache_dtype" and p.value == "auto" for p in points)


def _with_precision(rows: list[Measured]) -> list[Measured]:
    """rows, each but the fp reference (the uncapped kv_cache_dtype=auto run) with its greedy
    outputs compared to the reference's."""
    ref = next(m for m in rows if _is_fp(m.points))
    return [m if m is ref else dataclasses.replace(m, precision=compare_outputs(ref.run.records, m.run.records))
            for m in rows]


def _sweeps(rows: list[Measured]) -> dict[str, dict[Any, Any]]:
    sweeps: dict[str, dict[Any, Any]] = {}
    for m in rows:
        for p in m.points:
            sweeps.setdefault(p.variable, {})[p.value] = m.summary
    return sweeps


def _int8_precision(rows: list[Measured]) -> Precision | None:
    return next((m.precision for m in rows for p in m.points if p.variable == "kv_cache_dtype" and p.value == "int8"),
                None)


def _meta(ns: argparse.Namespace, requests: list[TraceRequest], walk: Walk) -> dict[str, Any]:
    base = walk.rows[0]
    return {
        "trace": str(ns.trace), "requests": len(requests), "repeats": ns.repeats, "quick": ns.quick,
        "time_scale": ns.time_scale,
        "mem_cap_tokens": walk.cap, "auto_acts_as": walk.auto_as,
        "peak_concurrent_tokens": peak_concurrent_tokens(base.run.records), "mean_seq_len": base.summary.mean_seq_len,
        "rules": {"tolerance": ns.tolerance, "min_int8_match": ns.min_int8_match, "min_cache_hit": ns.min_cache_hit},
        "not_started": [f"{v}={x}: {why}" for (v, x), why in walk.not_started.items()],
    }


def _report(ns: argparse.Namespace, walk: Walk, rec: Recommendation, meta: dict[str, Any]) -> None:
    """The table, tune.json, tune.png, and last the recommendation."""
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    b = walk.rows[0].args
    print(f"\n{meta['requests']} requests from {ns.trace}, mean sequence {meta['mean_seq_len']:.0f} tokens; baseline "
          f"page_size={b.page_size}, radix cache {'off' if b.disable_radix_cache else 'on'}, kv {b.kv_cache_dtype}, "
          f"preemption {b.preemption_mode}; cap runs: max_total_tokens={walk.cap}\n")
    print(table(walk.rows))
    for (variable, value), why in walk.not_started.items():
        print(f"{variable}={value}: not measured, the engine did not start: {why}")
    write_json(out / "tune.json", walk.rows, rec, meta)
    print(f"\nwrote {out / 'tune.json'}")
    if not ns.no_plot:
        plot(out / "tune.png", walk.rows, f"radixrt tune: {Path(ns.trace).name}, {meta['requests']} requests")
        print(f"wrote {out / 'tune.png'}")
    print(f"\nRecommended: {rec.command(b.model_path)}")
    for c in rec.choices:
        print(f"  {' '.join(c.flags) or f'{c.variable}={c.value} (no flag)'}: {c.reason}")

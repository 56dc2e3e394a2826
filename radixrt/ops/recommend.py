"""From measured sweeps to recommended `radixrt launch_server` flags, each with its reason.

Page size and preemption mode share one rule, `fastest`: among the values whose throughput is
within `tolerance` of the best, those whose TTFT p95 is within tolerance of the lowest tie, and
the tie goes to a stated preference. (A trace replayed at its arrival times bounds throughput by
its offered load, so latency decides while throughput only vetoes.)

  page_size        fastest; ties: the highest prefix hit rate, then the baseline's size.
  radix cache      on, unless it barely hits (hit rate below min_cache_hit) and off is faster by
                   more than tolerance in TTFT p50 without losing more than tolerance of
                   throughput. (A cache that hits skips prefill; off measuring faster then is
                   noise, and the reason says so.)
  kv_cache_dtype   int8 only when its greedy outputs match the fp (auto) run's with a mean
                   leading-token agreement of at least min_int8_match, and it keeps throughput
                   within tolerance; else auto.
  preemption_mode  under the memory cap: fastest; ties: recompute (no host memory), then auto,
                   then swap. With no retraction in any capped run the mode never acted, and
                   the baseline's is kept.

A configuration whose run had failed requests is never chosen while another has none.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass
from typing import Any, Callable

from radixrt.config import ServerArgs
from radixrt.ops.tune_metrics import Precision, Summary

TUNED_FIELDS = ("page_size", "disable_radix_cache", "kv_cache_dtype", "preemption_mode")
NOT_CARRIED = ("model_path", "log_level")  # not repeated from the baseline into the recommendation
PREEMPTION_PREFERENCE = ("recompute", "auto", "swap")


@dataclass(frozen=True)
class Rules:
    tolerance: float = 0.10
    min_int8_match: float = 0.95
    min_cache_hit: float = 0.05


@dataclass(frozen=True)
class Choice:
    """One tuned variable's recommended value: its launch_server flags (maybe none) and why."""

    variable: str
    value: Any
    flags: tuple[str, ...]
    reason: str


@dataclass(frozen=True)
class Recommendation:
    choices: tuple[Choice, ...]
    carried: tuple[str, ...]  # the baseline's own non-default flags, kept as given

    @property
    def flags(self) -> list[str]:
        return [*self.carried, *(f for c in self.choices for f in c.flags)]

    def command(self, model_path: str) -> str:
        return shlex.join(["radixrt", "launch_server", "--model-path", model_path, *self.flags])


def recommend(sweeps: dict[str, dict[Any, Summary]], precision: Precision | None, base: ServerArgs,
              rules: Rules = Rules(), not_started: dict[tuple[str, Any], str] | None = None) -> Recommendation:
    """sweeps: variable -> value -> the summary of the run that tried it (the variables of
    tune_plan.Point; every page size, radix cache value and kv "auto" present). precision: the int8
    run's outputs against the auto run's (None: not run). not_started: (variable, value) -> why
    its engine did not start (an int8 pool refused by its start-up check, say)."""
    not_started = not_started or {}
    mean_seq = sweeps["page_size"][base.page_size].mean_seq_len
    kv = sweeps["kv_cache_dtype"]
    choices = (
        choose_page_size(sweeps["page_size"], base.page_size, rules),
        choose_radix_cache(sweeps["radix_cache"]["on"], sweeps["radix_cache"]["off"], rules),
        choose_kv_dtype(kv["auto"], kv.get("int8"), precision, rules, not_started.get(("kv_cache_dtype", "int8"))),
        choose_preemption(sweeps.get("preemption_mode", {}), base.preemption_mode, base.swap_min_tokens, mean_seq,
                          rules),
    )
    return Recommendation(choices, tuple(carried_flags(base)))


def fastest(points: dict[Any, Summary], rules: Rules, prefer: Callable[[Any], Any]) -> Any:
    """The value of the shared rule (module docstring): prefer(value) ranks ties, highest wins."""
    pool = _healthy(points)
    top = max(s.throughput for s in pool.values())
    pool = {k: s for k, s in pool.items() if s.throughput >= top * (1 - rules.tolerance)}
    best = min(_ttft95(s) for s in pool.values())
    return max((k for k, s in pool.items() if _ttft95(s) <= best * (1 + rules.tolerance)), key=prefer)


def choose_page_size(points: dict[int, Summary], baseline: int, rules: Rules) -> Choice:
    pick = fastest(points, rules, prefer=lambda p: (round(points[p].hit_rate, 3), p == baseline))
    others = "; ".join(f"{p}: {_ms(_ttft95(s))}, {s.throughput:.0f} tok/s, hit {s.hit_rate:.1%}"
                       for p, s in points.items() if p != pick)
    s = points[pick]
    why = (f"TTFT p95 {_ms(_ttft95(s))}, {s.throughput:.0f} tok/s, prefix hit rate {s.hit_rate:.1%} (others {others}; "
           f"within {rules.tolerance:.0%} is a tie, going to the higher hit rate, then the baseline's size)")
    return Choice("page_size", pick, ("--page-size", str(pick)), why)


def choose_radix_cache(on: Summary, off: Summary, rules: Rules) -> Choice:
    faster_off = (_p50(off) < _p50(on) * (1 - rules.tolerance) and not off.failed
                  and off.throughput >= on.throughput * (1 - rules.tolerance))
    timing = (f"TTFT p50 {_ms(_p50(on))} on vs {_ms(_p50(off))} off, throughput {on.throughput:.0f} vs "
              f"{off.throughput:.0f} tok/s")
    if faster_off and on.hit_rate < rules.min_cache_hit:
        why = f"hit rate only {on.hit_rate:.0%} (< {rules.min_cache_hit:.0%}), and off measured faster: {timing}"
        return Choice("radix_cache", "off", ("--disable-radix-cache",), why)
    if faster_off:  # a cache that hits saves the prefill it skips; off winning here is not the cache's cost
        why = (f"hit rate {on.hit_rate:.0%}; off measured faster ({timing}) although the cache hits, which is "
               f"taken as noise: rerun with --repeats to confirm")
    else:
        why = f"hit rate {on.hit_rate:.0%}; {timing} (kept on unless off is faster by > {rules.tolerance:.0%})"
    return Choice("radix_cache", "on", (), why)


def choose_kv_dtype(auto: Summary, int8: Summary | None, precision: Precision | None, rules: Rules,
                    not_started: str | None = None) -> Choice:
    keep = Choice("kv_cache_dtype", "auto", ("--kv-cache-dtype", "auto"), "")
    if int8 is None or precision is None:
        return dataclasses.replace(keep, reason=f"int8 did not start: {not_started}" if not_started
                                   else "int8 was not measured")
    agree = (f"int8's greedy outputs: {precision.identical:.0%} of {precision.requests} requests identical to fp, "
             f"mean leading-token match {precision.leading_match:.2f} (threshold {rules.min_int8_match:.2f})")
    if precision.leading_match < rules.min_int8_match:
        return dataclasses.replace(keep, reason=f"{agree}: below the threshold, so int8 is not safe here")
    if int8.failed or int8.throughput < auto.throughput * (1 - rules.tolerance):
        return dataclasses.replace(keep, reason=f"{agree}, but throughput {int8.throughput:.0f} vs "
                                   f"{auto.throughput:.0f} tok/s fp (or failed requests)")
    saving = f"; KV {_bytes(auto)} -> {_bytes(int8)} per token" if auto.bytes_per_token and int8.bytes_per_token else ""
    why = f"{agree}: passes; throughput {int8.throughput:.0f} vs {auto.throughput:.0f} tok/s fp{saving}"
    return Choice("kv_cache_dtype", "int8", ("--kv-cache-dtype", "int8"), why)


def choose_preemption(modes: dict[str, Summary], baseline: str, swap_min_tokens: int, mean_seq: float,
                      rules: Rules) -> Choice:
    at = f"at this trace's mean sequence length of {mean_seq:.0f} tokens (auto swaps from {swap_min_tokens})"
    keep = Choice("preemption_mode", baseline, ("--preemption-mode", baseline), "")
    if not modes:
        return dataclasses.replace(keep, reason=f"no capped run started; kept {baseline}")
    if not any(s.retractions for s in modes.values()):
        why = f"no request was retracted even under the memory cap, so the mode never acted {at}; kept {baseline}"
        return dataclasses.replace(keep, reason=why)
    rank = {m: -i for i, m in enumerate(PREEMPTION_PREFERENCE)}
    pick = fastest(modes, rules, prefer=lambda m: rank.get(m, -len(rank)))
    why = (f"{at}, under the cap: {_runs(modes)}. {pick} is the fastest (within {rules.tolerance:.0%} is a tie, "
           f"going to {', then '.join(PREEMPTION_PREFERENCE)})")
    return Choice("preemption_mode", pick, ("--preemption-mode", pick), why)


def _runs(modes: dict[str, Summary]) -> str:
    """Each mode's measurements; a mode that shares another's run (auto acting as swap) says so."""
    parts, seen = [], {}
    for m, s in modes.items():
        if id(s) in seen:
            parts.append(f"{m}: acts as {seen[id(s)]} on every request here (one run for both)")
            continue
        seen[id(s)] = m
        parts.append(f"{m}: {s.throughput:.0f} tok/s, TTFT p95 {_ms(_ttft95(s))}, {s.retractions} retractions, "
                     f"{s.swaps_out} swapped, {s.recomputed_tokens} tokens recomputed")
    return "; ".join(parts)


def carried_flags(base: ServerArgs) -> list[str]:
    """launch_server flags for the baseline's non-default fields (other than the tuned ones)."""
    defaults = ServerArgs(model_path=base.model_path)
    flags: list[str] = []
    for f in dataclasses.fields(ServerArgs):
        value = getattr(base, f.name)
        if f.name in TUNED_FIELDS or f.name in NOT_CARRIED or value == getattr(defaults, f.name):
            continue
        flag = "--" + f.name.replace("_", "-")
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def _healthy(points: dict[Any, Summary]) -> dict[Any, Summary]:
    ok = {k: s for k, s in points.items() if not s.failed}
    return ok or points


def _metric(get: Callable[[Summary], float | None]) -> Callable[[Summary], float]:
    return lambda s: v if (v := get(s)) is not None else float("inf")


_ttft95 = _metric(lambda s: s.ttft_s.p95)
_p50 = _metric(lambda s: s.ttft_s.p50)


def _ms(seconds: float) -> str:
    return "n/a" if seconds == float("inf") else f"{seconds * 1000:.0f} ms"


def _bytes(s: Summary) -> str:
    return f"{s.bytes_per_token:.0f} B"

"""The tuning routine's configurations: one variable at a time away from a baseline.

The baseline is itself one point of every uncapped sweep (page size, radix cache, KV dtype),
so it is run once; the preemption sweep runs under a KV memory cap small enough that requests
get retracted, since without retractions the preemption mode never acts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from radixrt.config import ServerArgs

PAGE_SIZES = (8, 16, 32)
KV_DTYPES = ("auto", "int8")
PREEMPTION_MODES = ("recompute", "swap", "auto")
CAP_FRACTION = 1 / 3  # of the peak KV tokens the trace needs at once: tight enough to retract


@dataclass(frozen=True)
class Point:
    """One value of one variable: the server arguments that try it."""

    variable: str  # "page_size", "radix_cache", "kv_cache_dtype" or "preemption_mode"
    value: Any  # 16, "off", "int8", "swap", ...
    args: ServerArgs

    @property
    def label(self) -> str:
        if self.variable == "preemption_mode":
            return f"cap {self.args.max_total_tokens} {self.value}"
        return f"{self.variable}={self.value}"


def run_label(points: tuple[Point, ...], is_baseline: bool) -> str:
    """A run's name in the table: "baseline", its one point's label, or "cap N swap=auto" for a
    capped run that stands for two modes."""
    if is_baseline:
        return "baseline"
    if len(points) > 1 and points[0].variable == "preemption_mode":
        return f"{points[0].label}=" + "=".join(str(p.value) for p in points[1:])
    return points[0].label


def uncapped_points(base: ServerArgs) -> list[Point]:
    """Page sizes, radix cache on/off and KV dtypes, each varied alone from base (the baseline's
    own value among them, so that one point is the baseline)."""
    pages = _with_base(PAGE_SIZES, base.page_size)
    kv = _with_base(KV_DTYPES, base.kv_cache_dtype)
    cache_base = "off" if base.disable_radix_cache else "on"
    return (
        [Point("page_size", p, replace(base, page_size=p)) for p in pages]
        + [Point("radix_cache", v, _radix_cache(base, v == "on")) for v in _with_base(("on", "off"), cache_base)]
        + [Point("kv_cache_dtype", d, _kv_dtype(base, d)) for d in kv]
    )


def capped_points(base: ServerArgs, cap_tokens: int, auto_as: str | None = None) -> list[Point]:
    """The preemption modes, each under a KV pool of cap_tokens; auto shares the run of the mode
    auto_as when auto acts as that mode on every request (see auto_acts_as)."""
    def args(mode: str) -> ServerArgs:
        runs_as = auto_as if mode == "auto" and auto_as else mode
        return replace(base, max_total_tokens=cap_tokens, preemption_mode=runs_as)

    return [Point("preemption_mode", m, args(m)) for m in PREEMPTION_MODES]


def auto_acts_as(base: ServerArgs, prompt_lens: list[int], seq_lens: list[int]) -> str | None:
    """The mode preemption auto takes for every request of a trace, if one (then its run is not
    needed): recompute when no sequence reaches swap_min_tokens; swap when every prompt does and
    is prefilled in one chunk, since a running request then holds at least its prompt's KV when
    it is retracted (the scheduler retracts only for decode growth)."""
    one_chunk = base.chunked_prefill_size == -1 or base.chunked_prefill_size >= max(prompt_lens)
    if max(seq_lens) < base.swap_min_tokens:
        return "recompute"
    if one_chunk and min(prompt_lens) >= base.swap_min_tokens:
        return "swap"
    return None


def unique_args(points: list[Point]) -> list[ServerArgs]:
    """The distinct configurations to run (one engine each), in first-seen order."""
    return list(dict.fromkeys(p.args for p in points))


def memory_cap(peak_tokens: int, largest_seq: int, page_size: int, fraction: float = CAP_FRACTION) -> int:
    """About fraction * peak_tokens, rounded to whole pages, and at least one page more than the
    largest sequence needs (so every request fits alone and none is refused)."""
    floor = (math.ceil(largest_seq / page_size) + 1) * page_size
    return max(round(peak_tokens * fraction / page_size) * page_size, floor)


def _with_base(values: tuple[Any, ...], base_value: Any) -> tuple[Any, ...]:
    return values if base_value in values else (base_value, *values)


def _radix_cache(base: ServerArgs, on: bool) -> ServerArgs:
    # the hierarchical cache is a tier of the radix cache: off takes it along
    if on:
        return replace(base, disable_radix_cache=False)
    return replace(base, disable_radix_cache=True, enable_hierarchical_cache=False, hicache_dir=None)


def _kv_dtype(base: ServerArgs, dtype: str) -> ServerArgs:
    # fp8 scales are only valid with an fp8 pool
    scales = base.kv_scales_file if dtype.startswith("fp8") else None
    return replace(base, kv_cache_dtype=dtype, kv_scales_file=scales)

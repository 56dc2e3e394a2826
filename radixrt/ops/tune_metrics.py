"""What one replayed configuration measured: latency percentiles, throughput, KV use, prefix hit
rate, retractions; and how far two runs' greedy outputs agree (the quantized-KV precision check)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from radixrt.ops.replay import RequestRecord, RunResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), interpolating linearly between the closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass(frozen=True)
class Percentiles:
    """p50/p95/p99 of some seconds (None where nothing was measured)."""

    p50: float | None
    p95: float | None
    p99: float | None

    @classmethod
    def of(cls, values: Sequence[float]) -> Percentiles:
        return cls(percentile(values, 50), percentile(values, 95), percentile(values, 99))


@dataclass(frozen=True)
class Summary:
    """One configuration's measurements over one replay of the trace."""

    requests: int
    failed: int  # aborted by the server
    ttft_s: Percentiles
    tpot_s: Percentiles
    throughput: float  # output tokens / wall seconds
    peak_pool: float  # max (num_pages - free_pages) / num_pages
    peak_used: float  # max used_pages / num_pages
    hit_rate: float  # sum cached_tokens / sum prompt_tokens
    retractions: int  # these three: over all the run's replays
    swaps_out: int
    recomputed_tokens: int
    mean_seq_len: float  # prompt + output tokens per request
    bytes_per_token: float | None  # KV bytes per token of the pool (all layers)


def summarize(run: RunResult) -> Summary:
    recs = run.records
    ok = [r for r in recs if r.error is None]
    prompt = sum(r.prompt_tokens for r in recs)
    counters = run.counters
    return Summary(
        requests=len(recs),
        failed=len(recs) - len(ok),
        ttft_s=Percentiles.of([r.ttft for r in ok if r.ttft is not None]),
        tpot_s=Percentiles.of([r.tpot for r in ok if r.tpot is not None]),
        throughput=sum(r.completion_tokens for r in recs) / run.wall_s if run.wall_s > 0 else 0.0,
        peak_pool=run.kv_peak.pool,
        peak_used=run.kv_peak.used,
        hit_rate=sum(r.cached_tokens for r in recs) / prompt if prompt else 0.0,
        retractions=int(counters.get("retractions") or 0),
        swaps_out=int(counters.get("swaps_out") or 0),
        recomputed_tokens=int(counters.get("recomputed_tokens") or 0),
        mean_seq_len=sum(r.seq_len for r in recs) / len(recs) if recs else 0.0,
        bytes_per_token=counters.get("bytes_per_token"),
    )


@dataclass(frozen=True)
class Precision:
    """How a run's greedy outputs agree with a reference run's on the same requests."""

    requests: int
    identical: float  # share of requests whose output ids are identical
    leading_match: float  # mean over requests of (matching leading tokens / reference length)


def compare_outputs(reference: Sequence[RequestRecord], run: Sequence[RequestRecord]) -> Precision:
    """Request by request, in order (a run's records follow its requests, repeats included);
    raises ValueError if the two runs replayed different requests."""
    if [r.line for r in reference] != [r.line for r in run] or not reference:
        raise ValueError("the runs to compare replayed different requests")
    pairs = [(a.output_ids, b.output_ids) for a, b in zip(reference, run)]
    fractions = [_leading(a, b) / max(len(a), 1) for a, b in pairs]
    identical = sum(a == b for a, b in pairs)
    return Precision(len(pairs), identical / len(pairs), sum(fractions) / len(fractions))


def _leading(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def peak_concurrent_tokens(records: Sequence[RequestRecord]) -> int:
    """The most KV tokens the requests in flight (sent, not finished) needed at one time: each
    holds its prompt and output less the cached prefix it reused, so a shared prefix counts once
    (for the request that computed it)."""
    need = [(r, r.seq_len - r.cached_tokens) for r in records]
    events = sorted([(r.sent, n) for r, n in need] + [(r.finished, -n) for r, n in need],
                    key=lambda e: (e[0], e[1]))  # at a tie, a finish (negative) frees before a send takes
    level = peak = 0
    for _, delta in events:
        level += delta
        peak = max(peak, level)
    return peak

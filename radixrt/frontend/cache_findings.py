"""What the cache diagnosis's observations mean (frontend/cache_report.py keeps them): the report,
its divergence histogram and percentiles, and the causes each observation shows, with the advice
an operator reads. The heuristics are described in cache_report.py's docstring."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LOW_REPETITION_SHARE = 0.30  # a prompt sharing less of its tokens with recent texts repeats too little
CAUSE_MIN_SHARE = 0.25  # a cause is reported when at least this share of recent prompts shows it
DIVERGENCE_BUCKETS = (0, 16, 64, 256, 1024)  # upper edges (inclusive) of the histogram; then an open one
PERCENTILES = (10, 50, 90, 99)
CAUSE_KINDS = ("cache_disabled", "variable_start", "truncation", "evicted", "low_repetition")
ADVICE = {
    "cache_disabled": "the prefix cache is disabled (--disable-radix-cache): no prompt reuses cached KV, "
    "though {shared} of recent prompt tokens were shared with recent prompts.",
    "variable_start": "{pct} of prompts diverge within their first {first_n} tokens although their later "
    "content is shared with recent prompts: variable content (timestamps, ids) at the start of the prompt "
    "defeats prefix reuse; move it to the end.",
    "truncation": "{pct} of prompts keep a recent request's start and its last turn but drop the history "
    "between (cut at a median of {cut} tokens): a truncated or summarized multi-turn history loses the "
    "cache after the cut; keep histories append-only, or cut them rarely and in large steps.",
    "evicted": "{pct} of prompts share a longer prefix with a recent request than the cache still held: "
    "it was evicted (too little KV memory for the working set: raise --max-total-tokens or "
    "--mem-fraction-static) or the cache was flushed.",
    "low_repetition": "{pct} of prompts share less than {low} of their tokens with any recent prompt "
    "({shared} of all prompt tokens are shared): the workload repeats too little for the prefix cache "
    "to gain much.",
}


@dataclass(frozen=True)
class Observation:
    """What the diagnosis keeps of one finished request; the report derives everything from these."""

    prompt_len: int
    cached: int  # cached_tokens as the scheduler reported it
    divergence: int  # divergence_position(prompt_len, cached)
    shared_start: int  # max(divergence, the longest aligned prefix shared with a recent text)
    shared: int  # prompt tokens found in recent texts, at any offset (an estimate, in windows)
    resumes: bool  # a shared window starts within RESUME_PROBE_TOKENS after shared_start
    evicted: bool  # a recent text shared >= EVICTED_MIN_TOKENS more of the start than the cache served
    kept_tail: bool  # the prompt left the text of recent request R at shared_start, yet holds R's tail later
    system: bool  # content of the first SYSTEM_PROMPT_TOKENS was seen in a recent text, at any offset


# -- the report -----------------------------------------------------------------------------------


def build_report(observations: list[Observation], first_n: int, cache_enabled: bool) -> dict[str, Any]:
    """prompts, hit_rate (cached / prompt tokens), shared_token_rate (prompt tokens found in recent
    texts), the divergence histogram and percentiles, early_divergence_share (divergence within the
    first first_n tokens, fully matched prompts excepted), shared_prefix (prompts sharing a system
    prompt: count and hit rate), cause_shares (every kind's share of prompts) and causes (those at
    CAUSE_MIN_SHARE or more, most common first, cache_disabled always first): kind, share, message."""
    n = len(observations)
    prompt_tokens = sum(o.prompt_len for o in observations)
    divergences = sorted(o.divergence for o in observations)
    system = [o for o in observations if o.system]
    flagged = {kind: [o for o in observations if _shows(kind, o, first_n, cache_enabled)] for kind in CAUSE_KINDS}
    shares = {kind: _share(len(obs), n) for kind, obs in flagged.items()}
    details = {"first_n": first_n, "low": f"{LOW_REPETITION_SHARE:.0%}",
               "shared": f"{_share(sum(o.shared for o in observations), prompt_tokens):.0%}",
               "cut": _percentile(sorted(o.shared_start for o in flagged["truncation"]), 50)}
    return {
        "cache_enabled": cache_enabled,
        "prompts": n,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(o.cached for o in observations),
        "hit_rate": _share(sum(o.cached for o in observations), prompt_tokens),
        "shared_token_rate": _share(sum(o.shared for o in observations), prompt_tokens),
        "first_n": first_n,
        "early_divergence_share": _share(sum(o.divergence < min(first_n, o.prompt_len) for o in observations), n),
        "divergence": {
            "buckets": _buckets(divergences),
            "percentiles": {f"p{p}": _percentile(divergences, p) for p in PERCENTILES},
            "fully_matched_share": _share(sum(o.divergence == o.prompt_len for o in observations), n),
        },
        "shared_prefix": {"prompts": len(system),
                          "hit_rate": _share(sum(o.cached for o in system), sum(o.prompt_len for o in system))},
        "cause_shares": shares,
        "causes": _causes(shares, details),
    }


def _shows(kind: str, o: Observation, first_n: int, cache_enabled: bool) -> bool:
    """Whether one prompt shows a cause (the heuristics of the module's docstring)."""
    if kind == "cache_disabled":
        return not cache_enabled
    if kind == "variable_start":
        return o.shared_start < min(first_n, o.prompt_len) and o.resumes
    if kind == "truncation":
        return o.kept_tail and o.shared_start >= first_n
    if kind == "evicted":
        return o.evicted
    return o.shared < LOW_REPETITION_SHARE * o.prompt_len  # low_repetition


def _causes(shares: dict[str, float], details: dict[str, Any]) -> list[dict[str, Any]]:
    kinds = [k for k, s in shares.items() if s >= CAUSE_MIN_SHARE]
    kinds.sort(key=lambda k: (k != "cache_disabled", -shares[k]))
    return [{"kind": k, "share": shares[k], "message": ADVICE[k].format(pct=f"{shares[k]:.0%}", **details)}
            for k in kinds]


def _share(part: float, whole: float) -> float:
    return round(part / whole, 4) if whole else 0.0


def _percentile(ordered: list[int], p: int) -> int:
    """Nearest rank; 0 for no values."""
    return ordered[min(len(ordered) - 1, max(0, -(-p * len(ordered) // 100) - 1))] if ordered else 0


def _buckets(values: list[int]) -> dict[str, int]:
    """Counts per DIVERGENCE_BUCKETS range: "0", "1-16", ..., ">1024"."""
    counts, low = {}, 0
    for edge in DIVERGENCE_BUCKETS:
        counts[str(edge) if edge == low else f"{low}-{edge}"] = sum(low <= v <= edge for v in values)
        low = edge + 1
    counts[f">{DIVERGENCE_BUCKETS[-1]}"] = sum(v >= low for v in values)
    return counts

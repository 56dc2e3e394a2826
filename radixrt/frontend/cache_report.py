"""Why prompts miss the prefix cache: a diagnosis of recent finished requests (GET /cache_report).

Reuse needs an exact prefix: the radix cache serves a prompt up to the first token where it
diverges from everything cached. CacheDiagnosis keeps, for a ring of recent requests, where each
prompt diverged (its cached_tokens) and a bounded index of window hashes of their texts (prompt +
output), and from these tells the usual reasons for a low hit rate apart:

  variable_start  prompts diverge early, yet content right after is shared with recent texts
                  (a timestamp or request id in front defeats reuse of what follows);
  truncation      a prompt keeps a recent request's start and its last tokens, but not what lay
                  between (a multi-turn history truncated or summarized loses the cache after the cut);
  evicted         a recent text shared more of the prompt's start than the cache still held;
  low_repetition  little of the prompt is shared with anything recent: the cache gains little;
  cache_disabled  --disable-radix-cache.

Window hashing. A text is cut into aligned windows of WINDOW (W) tokens, [0, W), [W, 2W), ..., and
each is indexed by hash, as is each aligned prefix [0, kW) (a chain over the windows). Content shared
at the same offset shows as equal aligned windows; content shared at another offset is found by
hashing one side at W consecutive shifts: a shared run of 2W - 1 tokens holds an aligned window of
the other side at one of them. So one request costs O(prompt tokens / W) window hashes plus a fixed
number of probes, and never a scan over other prompts. Hash collisions only blur the diagnosis.

The heuristics, per prompt (thresholds: the constants below). shared_start = max(where it diverged
from the cache, the longest aligned prefix it shares with a recent text): where its start stops
being shared, with the cache or without it.
  variable_start  shared_start < first_n, and a window shared with a recent text starts within
                  RESUME_PROBE_TOKENS after it (a common system prompt diverges late: never early);
  truncation      shared_start >= first_n, short of the full text (prompt + output) of the recent
                  request R it shares that start with by more than EXTEND_SLACK (an append-only next
                  turn shares all of it), yet R's last TAIL_RUN tokens occur after the cut (the kept
                  turns); a fresh question after a common system prompt holds no other request's answer;
  evicted         that aligned prefix reaches EVICTED_MIN_TOKENS past where the cache served;
  low_repetition  under LOW_REPETITION_SHARE of the prompt's tokens occur in recent texts.
A cause is listed when at least CAUSE_MIN_SHARE of the recent prompts show it (LOW_REPETITION_SHARE,
CAUSE_MIN_SHARE and the report itself are in cache_findings.py).

Namespaces. A request is compared only with the recent texts of its own cache namespace (the
CacheNamespace of its cache_salt and extra_key, generate_input.cache_namespace): every hash is keyed
by the namespace value, field by field, so no salt can stand for another namespace's. So
nothing a tenant sends can tell whether a text appears in another tenant's prompts, through this
report or the /metrics gauges drawn from it; report() answers for one namespace or for all.

NOTE: recent texts are those of finished requests, in finish order: requests admitted together,
before any of them finished, share content the cache could not yet hold, and may show as evicted (or
variable start) the first time.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from radixrt.frontend.cache_findings import Observation, build_report
from radixrt.namespace import DEFAULT_NAMESPACE, CacheNamespace

logger = logging.getLogger(__name__)

CACHE_REPORT_FIRST_N = 16  # "early": divergence within a prompt's first N tokens (report's default)
RECENT_REQUESTS = 512  # the ring of finished requests the report covers
WINDOW = 16  # tokens per hashed window
MAX_INDEXED_TOKENS = 8192  # of each text, only this much is hashed (bounds the index and the cost)
RESUME_PROBE_TOKENS = 64  # after the shared start, shared content must resume this soon (variable start)
SYSTEM_PROMPT_TOKENS = 64  # early content that, seen in a recent text, marks a shared system prompt
TAIL_RUN = 2 * WINDOW - 1  # a text's last tokens (before its final one) that a truncated next turn keeps
EXTEND_SLACK = 2 * WINDOW  # a prompt sharing all but this much of a request's text extends it
EVICTED_MIN_TOKENS = WINDOW  # a recent text sharing this much more than the cache served: evicted
LOW_HIT_RATE = 0.30  # the warning's threshold, on prompts that share a system prompt
WARN_MIN_PROMPTS = 16  # ... over at least this many of them
WARN_WINDOW = 64  # ... the latest this many
WARN_PERIOD_S = 300.0  # at most one warning per this many seconds


def divergence_position(prompt_len: int, cached_tokens: int) -> int:
    """Where a prompt diverged from its longest cached match: cached_tokens, or prompt_len when all
    but the last token matched (the last one is always computed, for its logits)."""
    return prompt_len if cached_tokens >= prompt_len - 1 else max(cached_tokens, 0)


def _window_hash(ids: Sequence[int], start: int, length: int = WINDOW, ns: CacheNamespace = DEFAULT_NAMESPACE) -> int:
    """The hash of ids[start : start + length] within namespace ns (other namespaces never match it)."""
    return hash((ns, tuple(ids[start : start + length])))


@dataclass(frozen=True)
class Fingerprint:
    """The aligned window hashes of a text's first MAX_INDEXED_TOKENS tokens."""

    windows: tuple[int, ...]  # windows[i]: tokens [i*W, (i+1)*W)
    prefixes: tuple[int, ...]  # prefixes[i]: tokens [0, (i+1)*W), chained over windows[:i+1]


def fingerprint(ids: Sequence[int], ns: CacheNamespace = DEFAULT_NAMESPACE) -> Fingerprint:
    count = min(len(ids), MAX_INDEXED_TOKENS) // WINDOW
    windows = tuple(_window_hash(ids, i * WINDOW, WINDOW, ns) for i in range(count))
    prefixes, h = [], 0
    for w in windows:
        h = hash((h, w))
        prefixes.append(h)
    return Fingerprint(windows, tuple(prefixes))


@dataclass(frozen=True)
class Tail:
    """A text's TAIL_RUN tokens before its final one (a next turn may render that one anew): the
    run's hash, and each of its W windows' hash -> its offset in the run. A text holding the run
    holds one of these windows as an aligned window, so aligned windows alone find it."""

    run: int
    windows: dict[int, int]
    ns: CacheNamespace

    def found_in(self, ids: Sequence[int], aligned: Sequence[int], start: int) -> bool:
        """Whether ids (whose aligned window hashes are `aligned`) holds the run at or after start."""
        for i in range(-(-start // WINDOW), len(aligned)):
            offset = self.windows.get(aligned[i])
            if offset is not None and i * WINDOW - offset >= start:
                if _window_hash(ids, i * WINDOW - offset, TAIL_RUN, self.ns) == self.run:
                    return True
        return False


def tail_of(text: Sequence[int], ns: CacheNamespace = DEFAULT_NAMESPACE) -> Tail | None:
    end = min(len(text), MAX_INDEXED_TOKENS) - 1
    if end < TAIL_RUN:
        return None
    begin = end - TAIL_RUN
    windows = {_window_hash(text, begin + j, WINDOW, ns): j for j in range(WINDOW)}
    return Tail(_window_hash(text, begin, TAIL_RUN, ns), windows, ns)


@dataclass(frozen=True)
class _Recent:
    obs: Observation
    fp: Fingerprint  # of its whole text, prompt + output
    tail: Tail | None
    text_len: int
    ns: CacheNamespace


class CacheDiagnosis:
    """Why recent prompts miss the prefix cache. observe() is called once per finished request (from
    the frontend's receiving thread); report() may be called from any thread. Memory is bounded by
    `capacity` requests of at most MAX_INDEXED_TOKENS hashed tokens each. Logs a warning, at most once
    per warn_period_s, while the hit rate on prompts that share a system prompt stays below LOW_HIT_RATE."""

    def __init__(self, cache_enabled: bool = True, *, capacity: int = RECENT_REQUESTS,
                 warn_period_s: float = WARN_PERIOD_S, clock: Callable[[], float] = time.monotonic) -> None:
        if capacity < 1 or warn_period_s < 0:
            raise ValueError(f"capacity must be >= 1 and warn_period_s >= 0, got {capacity}, {warn_period_s}")
        self.cache_enabled = cache_enabled
        self._capacity = capacity
        self._warn_period_s = warn_period_s
        self._clock = clock
        self._warned_at: float | None = None
        self._lock = threading.Lock()  # guards everything below
        self._serial = 0
        self._recent: dict[int, _Recent] = {}  # serial -> request, oldest first
        self._windows: dict[int, int] = {}  # window hash -> serial of the latest recent text holding it
        self._prefixes: dict[int, int] = {}  # aligned prefix hash -> serial of the latest text holding it
        self._system: deque[tuple[int, int]] = deque(maxlen=WARN_WINDOW)  # (cached, prompt_len)

    def observe(self, prompt_ids: list[int], cached_tokens: int, output_ids: list[int],
                namespace: CacheNamespace = DEFAULT_NAMESPACE) -> None:
        """Record one finished request: its prompt, the prompt tokens it reused, what it generated,
        and its cache namespace (it is compared only with recent texts of the same one)."""
        text = list(prompt_ids) + list(output_ids)
        fp, tail = fingerprint(text, namespace), tail_of(text, namespace)  # hashed outside the lock
        with self._lock:
            obs = self._analyse(prompt_ids, cached_tokens, fp, namespace)
            self._remember(_Recent(obs, fp, tail, len(text), namespace))
            due = self._warning_due(obs)
        if due is not None:
            causes = self.report()["causes"]
            why = causes[0]["message"] if causes else "none found (see GET /cache_report)"
            logger.warning("prefix-cache hit rate is %.1f%% over the last %d prompts that share a system "
                           "prompt; likely cause: %s", 100 * due[0], due[1], why)

    def report(self, first_n: int = CACHE_REPORT_FIRST_N, only: CacheNamespace | None = None) -> dict[str, Any]:
        """The diagnosis of the recent requests as a JSON-able dict (see build_report): of those in
        namespace `only`, or of all (None). Its "scope" says which: "all" or "namespace"."""
        with self._lock:
            observations = [r.obs for r in self._recent.values() if only is None or r.ns == only]
        report = build_report(observations, first_n, self.cache_enabled)
        return {**report, "scope": "all" if only is None else "namespace"}

    # -- under the lock ------------------------------------------------------------------------

    def _analyse(self, prompt: Sequence[int], cached: int, fp: Fingerprint, ns: CacheNamespace) -> Observation:
        own = min(len(prompt), MAX_INDEXED_TOKENS) // WINDOW  # the prompt's aligned windows lead fp's
        depth = 0
        while depth < own and fp.prefixes[depth] in self._prefixes:
            depth += 1
        latest = self._recent.get(self._prefixes[fp.prefixes[depth - 1]]) if depth else None
        divergence = divergence_position(len(prompt), cached)
        start = max(divergence, depth * WINDOW)
        resume = self._first_shared(prompt, ns, start, start + RESUME_PROBE_TOKENS)
        aligned_hits = sum(w in self._windows for w in fp.windows[:own])
        shared = max(start, WINDOW * max(aligned_hits, self._hits_from(prompt, ns, resume)))
        kept_tail = (latest is not None and latest.tail is not None and start < latest.text_len - EXTEND_SLACK
                     and latest.tail.found_in(prompt, fp.windows[:own], start))
        system = self._first_shared(prompt, ns, 0, SYSTEM_PROMPT_TOKENS - WINDOW + 1) is not None
        return Observation(
            prompt_len=len(prompt), cached=cached, divergence=divergence, shared_start=start,
            shared=min(shared, len(prompt)), resumes=resume is not None,
            evicted=self.cache_enabled and depth * WINDOW >= divergence + EVICTED_MIN_TOKENS,
            kept_tail=kept_tail, system=system)

    def _first_shared(self, ids: Sequence[int], ns: CacheNamespace, start: int, stop: int) -> int | None:
        """The first position in [start, stop) whose window is in a recent text of ns (at any offset)."""
        stop = min(stop, min(len(ids), MAX_INDEXED_TOKENS) - WINDOW + 1)
        return next((i for i in range(start, stop) if _window_hash(ids, i, WINDOW, ns) in self._windows), None)

    def _hits_from(self, ids: Sequence[int], ns: CacheNamespace, start: int | None) -> int:
        """How many of the windows at start, start + W, ... are in recent texts (0 without a start)."""
        if start is None:
            return 0
        end = min(len(ids), MAX_INDEXED_TOKENS) - WINDOW + 1
        return sum(_window_hash(ids, i, WINDOW, ns) in self._windows for i in range(start, end, WINDOW))

    def _remember(self, recent: _Recent) -> None:
        serial = self._serial = self._serial + 1
        self._recent[serial] = recent
        for index, hashes in ((self._windows, recent.fp.windows), (self._prefixes, recent.fp.prefixes)):
            index.update(dict.fromkeys(hashes, serial))
        if len(self._recent) > self._capacity:
            self._forget(next(iter(self._recent)))

    def _forget(self, serial: int) -> None:
        # NOTE: FIFO order keeps this exact: any newer text holding a hash has overwritten its entry.
        old = self._recent.pop(serial)
        for index, hashes in ((self._windows, old.fp.windows), (self._prefixes, old.fp.prefixes)):
            for h in hashes:
                if index.get(h) == serial:
                    del index[h]

    def _warning_due(self, obs: Observation) -> tuple[float, int] | None:
        """(hit rate, prompts) of the latest prompts sharing a system prompt, when a warning is due now."""
        if not obs.system or not self.cache_enabled:
            return None
        self._system.append((obs.cached, obs.prompt_len))
        tokens = sum(n for _, n in self._system)
        rate = sum(c for c, _ in self._system) / tokens if tokens else 1.0
        now = self._clock()
        if len(self._system) < WARN_MIN_PROMPTS or rate >= LOW_HIT_RATE:
            return None
        if self._warned_at is not None and now - self._warned_at < self._warn_period_s:
            return None
        self._warned_at = now
        return rate, len(self._system)


MEMORY_FIGURES = ("unreachable_pages", "cascade_dropped_pages", "host_cached_pages", "disk_cached_pages",
                  "host_hit_pages", "disk_hit_pages", "tier_load_pages", "tier_recompute_pages", "pinned_pages",
                  "pin_budget_pages", "pinned_namespaces", "pins_taken", "pins_refused", "pinned_pages_expired",
                  "pinned_dropped_pages")


def memory_section(stats: Any) -> dict[str, int]:
    """The KV memory's figures for GET /cache_report (every namespace's: in an admin's report, or any
    on a server without api keys): what the tiers hold and give back, what is pinned, and
    unreachable pages (0 by design)."""
    return {name: getattr(stats, name) for name in MEMORY_FIGURES}



TENANT_FIGURES = ("requests", "prompt_tokens", "cached_tokens", "rejected", "waiting", "running", "cached_pages")
ADAPTER_FIGURES = ("requests", "prompt_tokens", "cached_tokens")


def tenants_section(stats: Any, only: str | None = None) -> dict[str, dict[str, float]]:
    """Per tenant (scheduler/tenants.py's labels: a name, "default" for requests without a salt
    or key, "other" past the first 16): its requests, prompt and cached tokens and hit rate, 503s,
    what waits and runs now, and the device pages its computed KV holds. only: that tenant's row."""
    return _labelled_rows(stats, "tenant_", TENANT_FIGURES, only)


def adapters_section(stats: Any) -> dict[str, dict[str, float]]:
    """Per LoRA adapter (scheduler/lora_slots.py's labels: a name, "other" past the first 16): its
    requests, prompt and cached tokens and hit rate."""
    return _labelled_rows(stats, "lora_", ADAPTER_FIGURES, None)


def _labelled_rows(stats: Any, prefix: str, figures: tuple[str, ...], only: str | None) -> dict[str, dict[str, float]]:
    rows: dict[str, dict[str, float]] = {}
    for figure in figures:
        for label, n in getattr(stats, prefix + figure).items():
            if only is None or label == only:
                rows.setdefault(label, dict.fromkeys(figures, 0))[figure] = n
    for row in rows.values():
        row["hit_rate"] = row["cached_tokens"] / row["prompt_tokens"] if row["prompt_tokens"] else 0.0
    return rows

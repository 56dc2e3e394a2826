"""Speculator: the scheduler's side of speculative decoding (drafts are request state).

Each step it chooses how many drafts each decoding request verifies (draft_length.py: from
the measured step cost and the request's acceptance), and where they come from:

  * NGRAM: the request's own output, or the n-gram index over the text the server cached in
    the request's namespace (its own prompt included), whichever matches the longer suffix
    (the index's as a tree, with speculative_ngram_max_bfs_breadth above 1);
    never another namespace's text: the
    speed of acceptance would tell a tenant what another one's text continues with, as prefix
    cache timing would;
  * STANDALONE: the worker's draft model proposes them (BatchEntry.propose). Its KV lives in
    a draft pool under the target's page ids, so every prefix cached for the target is cached
    for the draft, except pages a lower tier brought back (or a swap): the draft pool has no
    tiers. Those pages are "stale", and so is every page a request computes after one; a
    request whose prefix holds a stale page runs unspeculated.

A request runs unspeculated, counted by reason, when exact verification would need state the
worker keeps per sampled token: a grammar, logprobs, penalties, a retention policy, a quality
spot check (which scores the live logprobs). Stop ids and strings, min_new_tokens and seeds
work: the worker samples each draft position as plain decoding would, and the scheduler takes
the accepted tokens one by one through the stop checks.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from radixrt.messages import KVMove, MoveKind, SpecVerdict
from radixrt.namespace import CacheNamespace
from radixrt.scheduler.req import Req
from radixrt.settings.speculative import SpecSettings
from radixrt.speculative.draft_length import (
    EXPLORE_AFTER,
    AcceptanceRate,
    StepCost,
    plan_drafts,
    token_work,
)
from radixrt.speculative.draft_tree import is_chain
from radixrt.speculative.ngram_index import NgramIndex, SequenceLookup
from radixrt.speculative.ngram_tree import propose_tree
from radixrt.speculative.request_spec import RequestSpec

INDEX_TOKENS_PER_STEP = 2048  # ~4 ms of indexing per step at most (and one sequence at least)
UNSPECULATED = ("grammar", "logprobs", "penalties", "retention", "spot_check", "draft_kv")


@dataclass(frozen=True)
class Draft:
    """One request's drafts for a step: tokens to verify (NGRAM: a chain, or a tree by parents),
    or how many the worker's draft model proposes (STANDALONE)."""

    tokens: list[int]
    propose: int = 0
    parents: list[int] = field(default_factory=list)  # a tree's (speculative/draft_tree.py); empty: a chain

    @property
    def length(self) -> int:
        return len(self.tokens) or self.propose


def unspeculated_reason(r: Req) -> str | None:
    """Why r cannot be verified exactly in chains, or None."""
    sp = r.sampling
    if sp.constraint is not None:
        return "grammar"
    if r.return_logprob:
        return "logprobs"
    if sp.has_penalties:
        return "penalties"
    if r.retention is not None:
        return "retention"
    if r.spot_check:
        return "spot_check"
    return None


class Speculator:
    def __init__(self, settings: SpecSettings, page_size: int, context_length: int,
                 attention_per_position: float = 0.0) -> None:
        self.settings, self.page_size, self.context_length = settings, page_size, context_length
        self.attention_per_position = attention_per_position  # a token's work: token_work()
        self.enabled = settings.enabled
        self.ngram = settings.algorithm == "NGRAM"
        self.index = (NgramIndex(settings.min_window, settings.max_window, settings.branch_length, settings.capacity,
                                 settings.match_type) if self.ngram else None)
        self.cost = StepCost()
        self.server = AcceptanceRate()
        self.stale: set[int] = set()  # STANDALONE: device pages whose draft KV is missing or wrong
        self.unspeculated = dict.fromkeys(UNSPECULATED, 0)
        self.verify_steps = 0  # request decode steps on a speculating server
        self.drafted = 0  # of them, those that verified drafts
        self.tree_steps = 0  # of those, the ones whose drafts branched
        self.decode_tokens = 0  # tokens those steps gained
        self._queued: deque[tuple[CacheNamespace, list[int]]] = deque()  # text for the index, oldest first
        self._observed: tuple[float, float, float] | None = None  # the last decode-only step's work and seconds
        self._started: float | None = None  # when the last step began

    # -- requests ---------------------------------------------------------------------------

    def admit(self, r: Req) -> None:
        """r enters the running batch (its first admission, or again after a retraction)."""
        if not self.enabled:
            return
        if r.spec is None:
            why = unspeculated_reason(r)
            r.spec = RequestSpec(why)
            if why is not None:
                self.unspeculated[why] += 1
            elif self.ngram:
                # its prompt goes to the namespace's index, where the request finds it too; its own
                # lookup holds what follows (its output), so it stays as small as that
                self._queued.append((r.namespace, r.prompt_ids))
                r.spec.lookup = SequenceLookup(self.settings.min_window, self.settings.max_window)
                r.spec.lookup.extend(r.prompt_ids[-self.settings.max_window :])

    def release(self, r: Req) -> None:
        """r leaves the running batch: the text it cached joins its namespace's index."""
        if self.ngram and r.kv_len > 0:
            self._queued.append((r.namespace, r.tokens(0, r.kv_len)))

    def _index_queued(self) -> None:
        """Index the queued text, about INDEX_TOKENS_PER_STEP tokens of it (one sequence at least):
        indexing costs ~2 us a token, and a burst of admissions must not hold back their prefill."""
        budget = INDEX_TOKENS_PER_STEP
        while self._queued and budget > 0:
            namespace, tokens = self._queued.popleft()
            self.index.add(namespace, tokens)
            budget -= len(tokens)

    def flush(self) -> None:
        """The prefix cache emptied: forget its text, and every page is free (no stale draft KV)."""
        if self.index is not None:
            self.index.clear()
            self._queued.clear()
        self.stale.clear()

    # -- planning a step ----------------------------------------------------------------------

    def plan(self, decoding: list[Req], spare_pages: int) -> dict[Req, Draft]:
        """Drafts for this step's decoding requests, within spare_pages more pages than their
        plain decode steps take."""
        if not self.enabled or not decoding:
            return {}
        if self._queued:
            self._index_queued()
        live = [r for r in decoding if r.spec is not None and self._may_speculate(r)]
        caps = [self._cap(r) for r in live]
        lengths = caps
        if self.settings.policy == "adaptive":
            accept = [r.spec.record.smoothed(self.server) for r in live]
            work = [token_work(r.kv_len, self.attention_per_position) for r in live]
            fixed = sum(token_work(r.kv_len, self.attention_per_position) for r in decoding)
            lengths = plan_drafts(self.cost, accept, caps, work, fixed)
        drafts: dict[Req, Draft] = {}
        for r, k, cap in zip(live, lengths, caps):
            if k == 0 and cap > 0 and r.spec.idle >= EXPLORE_AFTER:
                k = 1  # measure its acceptance again
            extra = self._extra_pages(r, k)
            if k == 0 or extra > spare_pages:
                r.spec.idle += 1
                continue
            draft = self._draft(r, k)
            if draft.length:
                spare_pages -= self._extra_pages(r, draft.length)
                drafts[r] = draft
                r.spec.idle = 0
            else:
                r.spec.idle += 1
        for r in decoding:
            if r.spec is not None:
                r.spec.verify_ct += 1
        return drafts

    def _may_speculate(self, r: Req) -> bool:
        if r.spec.off is None and not self.ngram and r.spec.checked_at != r.admitted_at:
            self._check_draft_kv(r)
        return r.spec.off is None

    def _check_draft_kv(self, r: Req) -> None:
        """STANDALONE, r's first decode since its admission: a stale page in its prefix (brought
        back from a lower tier, or computed after one) turns it off, and makes its own later pages stale."""
        r.spec.checked_at = r.admitted_at
        held = r.kv.pages[: math.ceil(r.kv_len / self.page_size)]
        first = next((i for i, p in enumerate(held) if p in self.stale), None)
        if first is not None:
            r.spec.off = "draft_kv"
            self.unspeculated["draft_kv"] += 1
            self.stale.update(r.kv.pages[first:])

    def _cap(self, r: Req) -> int:
        """Drafts r may verify: its output and the context must hold every token a step may add."""
        room = min(r.remaining_tokens, self.context_length - r.seq_len) - 1
        return max(0, min(self.settings.max_drafts, room))

    def _extra_pages(self, r: Req, k: int) -> int:
        """Pages r's step takes for k drafts beyond its plain decode step's."""
        ps, end = self.page_size, r.kv.kv_len + 1
        return max(0, math.ceil((end + k) / ps) - max(len(r.kv.pages), math.ceil(end / ps)))

    def _draft(self, r: Req, k: int) -> Draft:
        if not self.ngram:
            return Draft([], propose=k)
        matched, own = r.spec.lookup.match(k)  # the request's own text, unless the namespace's matches longer
        s = self.settings
        context = r.tokens(max(0, r.seq_len - s.max_window), r.seq_len)
        if not s.trees:
            return Draft(self.index.propose(r.namespace, context, k, longer_than=matched - 1) or own)
        tree = propose_tree(self.index, r.namespace, context, k, s.min_breadth, s.max_breadth, longer_than=matched - 1)
        if not tree.tokens:
            return Draft(own)
        return Draft(tree.tokens, parents=[] if is_chain(tree.parents) else tree.parents)

    def wrote(self, r: Req, pages: list[int], draft: Draft) -> None:
        """r's entry of this step verifies `draft` (empty: none) and writes these pages' KV, draft
        KV too. STANDALONE: the pages are fresh, unless r's prefix is stale."""
        if r.spec is not None:
            r.spec.pending, r.spec.branched = draft.length, bool(draft.parents)
        if self.enabled and not self.ngram:
            if r.spec is not None and r.spec.off == "draft_kv":
                self.stale.update(pages)
            else:
                self.stale.difference_update(pages)

    def moved(self, moves: list[KVMove]) -> None:
        """STANDALONE: pages filled from a lower tier or a swap hold target KV only."""
        if self.enabled and not self.ngram:
            for m in moves:
                if m.kind in (MoveKind.H2D, MoveKind.DISK2D):
                    self.stale.update(m.dst)

    # -- results --------------------------------------------------------------------------------

    def verified(self, r: Req, verdict: SpecVerdict) -> None:
        r.spec.record.add(len(verdict.draft), verdict.accepted)
        self.server.add(len(verdict.draft), verdict.accepted)
        self.drafted += 1
        self.tree_steps += bool(r.spec.branched)

    def gained(self, r: Req, tokens: list[int], decoding: bool) -> None:
        """r's output grew by tokens (after any step): its own text index follows."""
        if r.spec is None:
            return
        if r.spec.lookup is not None:
            r.spec.lookup.extend(tokens)
        if decoding:
            self.verify_steps += 1
            self.decode_tokens += len(tokens)

    def observe_step(self, steps: list[tuple[Req, int]], seconds: float) -> None:
        """A decode-only step of these (request, tokens run) ran in the worker for `seconds`: its
        work, drafts included. It is fitted at the next step's start (step_started), with the
        time the whole step took if longer: the scheduler's own work and the frontend's, on the
        same cores, are part of what a draft costs."""
        if self.enabled:
            a = self.attention_per_position
            plain = drafted = 0.0
            for r, n in steps:
                # before the batch is applied, kv_len is where its rows start: row j attends kv_len + j + 1
                plain += n * token_work(r.kv_len, a)
                k = r.spec.pending if r.spec is not None else 0
                drafted += k * token_work(r.kv_len + n, a) + a * k * (k + 1) / 2
            self._observed = (plain, drafted, seconds)

    def step_started(self, now: float) -> None:
        """A step begins at `now` (perf_counter): the last one's observation is fitted."""
        if self._observed is not None and self._started is not None:
            plain, drafted, seconds = self._observed
            self.cost.observe(plain, drafted, max(seconds, now - self._started))
        self._observed, self._started = None, now

    def stats(self) -> dict[str, object]:
        c0, c1, c2 = self.cost.coefficients() if self.cost.known else (0.0, 0.0, 0.0)
        return {
            "spec_accept_length": self.decode_tokens / self.verify_steps if self.verify_steps else 0.0,
            "spec_accept_rate": self.server.rate,
            "spec_draft_tokens": self.server.proposed,
            "spec_accepted_tokens": self.server.accepted,
            "spec_verify_steps": self.verify_steps,
            "spec_drafted_steps": self.drafted,
            "spec_tree_steps": self.tree_steps,
            "spec_mean_draft_length": self.server.proposed / self.drafted if self.drafted else 0.0,
            "spec_unspeculated_requests": dict(self.unspeculated),
            "spec_ngram_index_entries": self.index.entries if self.index is not None else 0,
            "spec_ngram_index_bytes": self.index.approx_bytes if self.index is not None else 0,
            "spec_stale_draft_pages": len(self.stale),
            "spec_step_seconds_fixed": c0,
            "spec_step_seconds_per_token": c1,
            "spec_step_seconds_per_draft": c2,
        }

"""RetentionRules: which bounded-KV policy each request runs under, and the policies' counters.

The server's settings (--kv-retention ...) with a request's override applied become
its RetentionBudget, or a refusal that names the field: a worker that cannot run the
policy (heavy_hitter needs an attention backend that reports attention mass), a
longrope model (its rope factors change with the sequence length, so keys cannot be
re-rotated), or a budget larger than a page table holds.
"""

from __future__ import annotations

import math

from radixrt.messages import WorkerReady
from radixrt.retention import POLICIES, REQUEST_NAMES, SERVER_NAMES, Retention, RetentionIn
from radixrt.scheduler.req import Req
from radixrt.scheduler.retention import RetentionBudget


class RetentionRules:
    def __init__(self, defaults: Retention, worker: WorkerReady) -> None:
        self.defaults = defaults
        self.page_size = worker.page_size
        self.context_length = worker.context_length
        self.table_pages = math.ceil(worker.context_length / worker.page_size)  # a slot's page-table columns
        self.refusals = worker.retention_refusals
        self.longrope = worker.long_prompt_threshold > 0
        self.requests = dict.fromkeys(POLICIES, 0)  # admitted requests per policy
        self.dropped_pages = 0
        self.peak_pages = 0  # the most pages a request under a policy held after a step
        _, why = self.budget(None)
        if why is not None:  # the server's own settings: refuse to start
            raise ValueError(why)

    def budget(self, override: RetentionIn | None) -> tuple[RetentionBudget | None, str | None]:
        """(the request's budget, None: it keeps all its KV; why it is refused, or None)."""
        spec = self.defaults.with_override(override)
        names = REQUEST_NAMES if override is not None else SERVER_NAMES
        why = spec.problem(names)
        if why is not None or not spec.active:
            return None, why
        if spec.policy in self.refusals:
            return None, f"{names['policy']} {spec.policy}: {self.refusals[spec.policy]}"
        if self.longrope:
            return None, (f"{names['policy']} {spec.policy}: not with a longrope model (its rope factors change "
                          "with the sequence length, so kept keys cannot be re-positioned)")
        b = RetentionBudget.of(spec, self.page_size)
        if b.max_pages > self.table_pages:
            return None, (f"{names['window_tokens']}: the policy keeps up to {b.max_tokens} tokens, more than the "
                          f"context length of {self.context_length}")
        return b, None

    def count_request(self, r: Req) -> None:
        self.requests[r.retention.policy if r.retention is not None else "none"] += 1

    def after_growth(self, r: Req, dropped_pages: int) -> None:
        if r.retention is not None:
            self.dropped_pages += dropped_pages
            self.peak_pages = max(self.peak_pages, len(r.kv.pages))

    def stats(self, running: list[Req]) -> dict[str, int | float]:
        """Counters, and the retained share of the running policy requests' computed KV (1.0: none)."""
        bounded = [r for r in running if r.retention is not None]
        computed = sum(r.kv_len for r in bounded)
        retained = sum(r.kv.kv_len for r in bounded) / computed if computed else 1.0
        return {
            "kv_retention_dropped_pages": self.dropped_pages,
            "kv_retention_peak_pages": self.peak_pages,
            "kv_retention_retained_fraction": retained,
            "kv_retention_requests": dict(self.requests),
        }

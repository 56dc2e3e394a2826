"""RetentionRules: the settings a request runs under, resolved once at the door.

The server's settings (--kv-retention ...) with a request's override applied (its
fields already checked: settings.parse_override) become the request's Retention,
which TokenizedRequest carries to the scheduler, or a refusal that names the
field: a worker that cannot run the policy (heavy_hitter needs an attention
backend that reports attention mass), a longrope model (its rope factors change
with the sequence length, so keys cannot be re-rotated), or a budget larger than
a page table holds. The server's own settings are checked the same way at start.
"""

from __future__ import annotations

import math

from radixrt.errors import RequestError
from radixrt.messages import WorkerReady
from radixrt.retention.policies import budget_for
from radixrt.settings.retention import (
    REQUEST_NAMES,
    SERVER_NAMES,
    Retention,
    RetentionIn,
)


class RetentionRules:
    def __init__(self, defaults: Retention, page_size: int, context_length: int, refusals: dict[str, str],
                 longrope: bool) -> None:
        """refusals: why the worker cannot run a policy, by name (absent: it can). ValueError naming
        the flag when the worker cannot run the server's own settings."""
        self.defaults = defaults
        self.page_size = page_size
        self.context_length = context_length
        self.table_pages = math.ceil(context_length / page_size)  # a slot's page-table columns
        self.refusals = refusals
        self.longrope = longrope
        why = self._refusal(defaults, SERVER_NAMES)
        if why is not None:  # the server's own settings: refuse to start
            raise ValueError(why)

    @classmethod
    def for_worker(cls, defaults: Retention, worker: WorkerReady) -> RetentionRules:
        return cls(defaults, worker.page_size, worker.context_length, worker.retention_refusals,
                   worker.long_prompt_threshold > 0)

    def resolve(self, override: RetentionIn | None) -> Retention | None:
        """The settings a request with this override runs under; None: it keeps all its KV.
        RequestError naming the field when this worker cannot run them."""
        spec = self.defaults.with_override(override)
        why = self._refusal(spec, REQUEST_NAMES if override is not None else SERVER_NAMES)
        if why is not None:
            raise RequestError(why, "kv_retention")
        return spec if spec.active else None

    def _refusal(self, spec: Retention, names: dict[str, str]) -> str | None:
        b = budget_for(spec, self.page_size)
        if b is None:
            return None
        policy = spec.policy.value
        if policy in self.refusals:
            return f"{names['policy']} {policy}: {self.refusals[policy]}"
        if self.longrope:
            return (f"{names['policy']} {policy}: not with a longrope model (its rope factors change "
                    "with the sequence length, so kept keys cannot be re-positioned)")
        if b.max_pages > self.table_pages:
            return (f"{names['window_tokens']}: the policy keeps up to {b.max_tokens} tokens, more than the "
                    f"context length of {self.context_length}")
        return None

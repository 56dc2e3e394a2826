"""Bounded-KV retention settings: which policy a request runs under, and its parameters.

A server has defaults (--kv-retention, --kv-sink-tokens, --kv-window-tokens,
--kv-heavy-ratio); a request may override any of them with
`sampling_params.kv_retention`: a policy name, or an object with the same fields
without the `kv_` prefix ({"policy": "sink_window", "window_tokens": 256}).
Fields left out take the server's values. The scheduler turns the settings into
page budgets (radixrt/scheduler/retention.py).

  * none: every token's KV stays until the request ends (the default);
  * sink_window: StreamingLLM / Scissorhands: the first sink_tokens (rounded up
    to whole pages) and the last window_tokens;
  * heavy_hitter: H2O: the last window_tokens plus heavy_ratio * window_tokens
    more, the pages that drew the most attention so far.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from radixrt.errors import RequestError, from_validation

POLICIES = ("none", "sink_window", "heavy_hitter")
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]


class RetentionIn(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """A request's override; None: the server's value."""

    policy: str | None = None
    sink_tokens: NonNegInt | None = None
    window_tokens: NonNegInt | None = None
    heavy_ratio: float | None = None


class Retention(msgspec.Struct, frozen=True):
    """Resolved settings (the server's, with a request's override applied)."""

    policy: str = "none"
    sink_tokens: int = 4
    window_tokens: int = 1024
    heavy_ratio: float = 0.2

    @property
    def active(self) -> bool:
        return self.policy != "none"

    def problem(self, names: dict[str, str]) -> str | None:
        """Why these settings are invalid, naming the field as `names` spells it; None if valid."""
        if self.policy not in POLICIES:
            return f"{names['policy']} must be one of {', '.join(POLICIES)}, got {self.policy!r}"
        if self.sink_tokens < 0:
            return f"{names['sink_tokens']} must be >= 0, got {self.sink_tokens}"
        if self.window_tokens < 1:
            return f"{names['window_tokens']} must be >= 1, got {self.window_tokens}"
        if not 0 < self.heavy_ratio < 1:
            return f"{names['heavy_ratio']} must be in (0, 1), got {self.heavy_ratio}"
        return None

    def with_override(self, override: RetentionIn | None) -> Retention:
        if override is None:
            return self
        given = {k: v for k, v in msgspec.structs.asdict(override).items() if v is not None}
        return msgspec.structs.replace(self, **given)


SERVER_NAMES = {"policy": "kv_retention", "sink_tokens": "kv_sink_tokens", "window_tokens": "kv_window_tokens",
                "heavy_ratio": "kv_heavy_ratio"}
REQUEST_NAMES = {k: f"sampling_params.kv_retention.{k}" for k in SERVER_NAMES}


def parse_override(value: str | dict | RetentionIn | None) -> RetentionIn | None:
    """A request's kv_retention as sent (a policy name or an object) -> RetentionIn; RequestError naming the field."""
    if value is None:
        return None
    override = value
    if not isinstance(value, RetentionIn):
        try:
            override = msgspec.convert({"policy": value} if isinstance(value, str) else value, RetentionIn)
        except msgspec.ValidationError as e:
            raise from_validation(e, "sampling_params.kv_retention.") from None
    why = Retention().with_override(override).problem(REQUEST_NAMES)
    if why is not None:
        raise RequestError(why, "kv_retention")
    return override

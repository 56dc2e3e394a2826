"""Bounded-KV retention settings: which policy a request runs under, and its parameters.

A server has defaults (--kv-retention, --kv-sink-tokens, --kv-window-tokens,
--kv-heavy-ratio); a request may override any of them with
`sampling_params.kv_retention`: a policy name, or an object with the same fields
without the `kv_` prefix ({"policy": "sink_window", "window_tokens": 256}).
Fields left out take the server's values. The door checks an override field by
field (`parse_override`) and resolves it against the server and its worker once
(rules.py); the scheduler turns the resolved settings into a page budget (policies.py).

  * none: every token's KV stays until the request ends (the default);
  * sink_window: StreamingLLM / Scissorhands: the first sink_tokens (rounded up
    to whole pages) and the last window_tokens;
  * heavy_hitter: H2O: the last window_tokens plus heavy_ratio * window_tokens
    more, the pages that drew the most attention so far.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated

import msgspec

from radixrt.errors import RequestError, from_validation
from radixrt.settings.fields import arg


class RetentionPolicy(enum.Enum):
    """A bounded-KV retention policy, by the name flags, requests and metrics use."""

    NONE = "none"
    SINK_WINDOW = "sink_window"
    HEAVY_HITTER = "heavy_hitter"


POLICY_NAMES = tuple(p.value for p in RetentionPolicy)
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=(1 << 62))]


class RetentionIn(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, frozen=True):
    """An override as sent (a request's, or the server's flags); None: the value it overrides."""

    policy: str | None = None
    sink_tokens: NonNegInt | None = None
    window_tokens: NonNegInt | None = None
    heavy_ratio: float | None = None

    def problem(self, names: dict[str, str]) -> str | None:
        """Why the fields given are invalid, naming the field as `names` spells it; None if valid."""
        if self.policy is not None and self.policy not in POLICY_NAMES:
            return f"{names['policy']} must be one of {', '.join(POLICY_NAMES)}, got {self.policy!r}"
        if self.sink_tokens is not None and self.sink_tokens < 0:
            return f"{names['sink_tokens']} must be >= 0, got {self.sink_tokens}"
        if self.window_tokens is not None and self.window_tokens < 1:
            return f"{names['window_tokens']} must be >= 1, got {self.window_tokens}"
        if self.heavy_ratio is not None and not 0 < self.heavy_ratio < 1:
            return f"{names['heavy_ratio']} must be in (0, 1), got {self.heavy_ratio}"
        return None


class Retention(msgspec.Struct, frozen=True):
    """Resolved settings (the server's, with a request's override applied)."""

    policy: RetentionPolicy = RetentionPolicy.NONE
    sink_tokens: int = 4
    window_tokens: int = 1024
    heavy_ratio: float = 0.2

    @property
    def active(self) -> bool:
        return self.policy is not RetentionPolicy.NONE

    def with_override(self, override: RetentionIn | None) -> Retention:
        """These settings with the fields override gives (checked: RetentionIn.problem) in their place."""
        if override is None:
            return self
        given = {k: v for k, v in msgspec.structs.asdict(override).items() if v is not None}
        if "policy" in given:
            given["policy"] = RetentionPolicy(given["policy"])
        return msgspec.structs.replace(self, **given)


SERVER_NAMES = {"policy": "kv_retention", "sink_tokens": "kv_sink_tokens", "window_tokens": "kv_window_tokens",
                "heavy_ratio": "kv_heavy_ratio"}
REQUEST_NAMES = {k: f"sampling_params.kv_retention.{k}" for k in SERVER_NAMES}


def server_settings(policy: str, sink_tokens: int, window_tokens: int, heavy_ratio: float) -> Retention:
    """The server's settings from its flags; ValueError naming the flag."""
    given = RetentionIn(policy, sink_tokens, window_tokens, heavy_ratio)
    why = given.problem(SERVER_NAMES)
    if why is not None:
        raise ValueError(why)
    return Retention().with_override(given)


@dataclass(frozen=True)
class RetentionArgs:
    kv_retention: str = arg(
        "none", "bounded KV per request: none (keep every token), sink_window (the first kv_sink_tokens and the last "
        "kv_window_tokens, StreamingLLM) or heavy_hitter (the last kv_window_tokens and the pages that drew the most "
        "attention, H2O); a request under a policy may generate past the context length. Requests may override it "
        "(sampling_params.kv_retention)"
    )
    kv_sink_tokens: int = arg(4, "sink_window: leading tokens always kept (rounded up to whole pages)")
    kv_window_tokens: int = arg(1024, "sink_window and heavy_hitter: the most recent tokens kept")
    kv_heavy_ratio: float = arg(
        0.2, "heavy_hitter: heavy-hitter tokens kept beyond the window, as a fraction of kv_window_tokens (H2O's 0.2)"
    )

    def check(self) -> None:
        _ = self.retention  # ValueError naming the flag

    @property
    def retention(self) -> Retention:
        """The server's retention settings (requests may override them)."""
        return server_settings(self.kv_retention, self.kv_sink_tokens, self.kv_window_tokens, self.kv_heavy_ratio)


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
    why = override.problem(REQUEST_NAMES)
    if why is not None:
        raise RequestError(why, "kv_retention")
    return override

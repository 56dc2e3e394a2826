"""cache_control: a request's ask that its prompt stay cached for a time (a pin with a TTL).

The field is in the spirit of Anthropic's prompt caching, `{"type": "ephemeral", "ttl": "5m"}`
(SGLang 0.5.9 has no pin API): "ephemeral" is the only type; the ttl is Anthropic's "5m" or
"1h", any "<N>s", "<N>m" or "<N>h", or a number of seconds, above 0 and at most 24 hours;
without a ttl the pin lasts 5 minutes, as Anthropic's does. It is resolved here, at the door,
into TokenizedRequest.pin_ttl (seconds); anything else is a 400 naming the field and what it
accepts. What a pin keeps, and its budget, is the scheduler's business.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Union

import msgspec

from radixrt.errors import RequestError
from radixrt.messages import MAX_PIN_TTL_S

CACHE_TYPES = ("ephemeral",)
DEFAULT_TTL_S = 300.0  # Anthropic's default: 5 minutes
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smh])")
ACCEPTED_TTL = '"5m", "1h", "<N>s", "<N>m", "<N>h" or a number of seconds, above 0 and at most 24h'


class CacheControl(msgspec.Struct, forbid_unknown_fields=True):
    """Keep this request's prompt cached for ttl (its full pages: they may move to the host or
    disk tier, but are not dropped before the ttl runs out). A later request with the field
    refreshes the ttl of the pages it shares."""

    # A plain str checked in pin_ttl (a 400 naming cache_control and the types); the enum is for the docs.
    type: Annotated[str, msgspec.Meta(extra_json_schema={"enum": list(CACHE_TYPES)})]
    ttl: Annotated[Union[str, float, None], msgspec.Meta(
        description=f"{ACCEPTED_TTL}; absent or null: 5m")] = None


def pin_ttl(cc: CacheControl | None) -> float | None:
    """The pin's length in seconds (None: no pin). Raises RequestError naming cache_control."""
    if cc is None:
        return None
    if cc.type not in CACHE_TYPES:
        accepted = " or ".join(f'"{t}"' for t in CACHE_TYPES)
        raise RequestError(f"cache_control.type must be {accepted}, got {cc.type!r}"[:300], "cache_control")
    if cc.ttl is None:
        return DEFAULT_TTL_S
    seconds = _seconds(cc.ttl)
    if seconds is None or not 0 < seconds <= MAX_PIN_TTL_S:
        raise RequestError(f"cache_control.ttl must be {ACCEPTED_TTL}, got {cc.ttl!r}"[:300], "cache_control")
    return seconds


def _seconds(ttl: str | float) -> float | None:
    """ttl in seconds, or None when it is not a duration."""
    if isinstance(ttl, str):
        m = _DURATION.fullmatch(ttl)
        return float(m.group(1)) * _UNIT_S[m.group(2)] if m else None
    return float(ttl) if math.isfinite(ttl) else None

"""Admission order of waiting requests (`--schedule-policy`).

lpm: longest cached prefix first, so requests that hit the cache run while
their prefix is still there (and prefixes are shared before they are evicted).
Over a long queue the matching costs more than it saves (as SGLang found), so
lpm falls back to arrival order past LPM_MAX_QUEUE requests.
"""

from __future__ import annotations

from typing import Callable

from radixrt.scheduler.req import Req

LPM_MAX_QUEUE = 128


def fcfs(waiting: list[Req], prefix_len: Callable[[Req], int]) -> list[Req]:
    """First come, first served (retracted requests were put back at the front)."""
    return list(waiting)


def lpm(waiting: list[Req], prefix_len: Callable[[Req], int]) -> list[Req]:
    if len(waiting) > LPM_MAX_QUEUE:
        return list(waiting)
    return sorted(waiting, key=lambda r: -prefix_len(r))  # stable: ties keep arrival order


SCHEDULE_POLICIES = {"lpm": lpm, "fcfs": fcfs}

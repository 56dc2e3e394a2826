"""Admission order of waiting requests (`--schedule-policy`)."""

from __future__ import annotations

from radixrt.scheduler.req import Req


def fcfs(waiting: list[Req]) -> list[Req]:
    """First come, first served (retracted requests were put back at the front)."""
    return waiting


SCHEDULE_POLICIES = {"fcfs": fcfs}

"""A request trace: JSONL, one request per line, validated as it is read.

Each line is an object with exactly these fields:

    arrival     seconds since the trace's start (a number >= 0)
    prompt      the request's text             } exactly one of the two
    input_ids   the request's token ids (ints) }
    output_len  tokens to generate (an int >= 1; replayed with ignore_eos, so exactly this many)

Prefix sharing (a system prompt, few-shot examples, a conversation's history) is just shared
leading text or ids. Blank lines are skipped; anything else that is wrong raises TraceError
naming the file, the line and the field.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

FIELDS = ("arrival", "prompt", "input_ids", "output_len")


class TraceError(ValueError):
    """A trace line that is not a valid request (the message names the line and the field)."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace. Exactly one of prompt and input_ids is set."""

    line: int  # 1-based line of the trace file: how errors and results name the request
    arrival: float
    output_len: int
    prompt: str | None = None
    input_ids: tuple[int, ...] | None = None

    def generate_kwargs(self) -> dict[str, Any]:
        """The prompt argument of Engine.generate/async_generate."""
        return {"prompt": self.prompt} if self.prompt is not None else {"input_ids": list(self.input_ids or ())}


def load_trace(path: str | Path) -> list[TraceRequest]:
    """The requests of a JSONL trace, ordered by arrival (ties keep file order).
    Raises TraceError for an unreadable, empty or invalid trace."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise TraceError(f"cannot read trace {path}: {e.strerror}") from None
    requests = [parse_line(text, n, path.name) for n, text in enumerate(lines, 1) if text.strip()]
    if not requests:
        raise TraceError(f"{path.name}: the trace has no requests")
    return sorted(requests, key=lambda r: r.arrival)


def parse_line(text: str, line: int, source: str = "trace") -> TraceRequest:
    """One trace line -> a TraceRequest; raises TraceError naming `source` line `line` and the field."""
    where = f"{source} line {line}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise TraceError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(FIELDS))
    if unknown:
        raise TraceError(f"{where}: unknown field {unknown[0]!r} (fields: {', '.join(FIELDS)})")
    if ("prompt" in obj) == ("input_ids" in obj):
        raise TraceError(f"{where}: give exactly one of 'prompt' and 'input_ids'")
    return TraceRequest(
        line=line,
        arrival=_arrival(obj, where),
        output_len=_output_len(obj, where),
        prompt=_prompt(obj, where) if "prompt" in obj else None,
        input_ids=_input_ids(obj, where) if "input_ids" in obj else None,
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _arrival(obj: dict[str, Any], where: str) -> float:
    v = obj.get("arrival")
    if v is None:
        raise TraceError(f"{where}: field 'arrival' is missing")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise TraceError(f"{where}: field 'arrival' must be a number of seconds >= 0, got {v!r}")
    return float(v)


def _output_len(obj: dict[str, Any], where: str) -> int:
    v = obj.get("output_len")
    if v is None:
        raise TraceError(f"{where}: field 'output_len' is missing")
    if not _is_int(v) or v < 1:
        raise TraceError(f"{where}: field 'output_len' must be an integer >= 1, got {v!r}")
    return v


def _prompt(obj: dict[str, Any], where: str) -> str:
    v = obj["prompt"]
    if not isinstance(v, str) or not v:
        raise TraceError(f"{where}: field 'prompt' must be a non-empty string")
    return v


def _input_ids(obj: dict[str, Any], where: str) -> tuple[int, ...]:
    v = obj["input_ids"]
    if not isinstance(v, list) or not v:
        raise TraceError(f"{where}: field 'input_ids' must be a non-empty list of token ids")
    bad = next((i for i, t in enumerate(v) if not _is_int(t) or t < 0), None)
    if bad is not None:
        raise TraceError(f"{where}: field 'input_ids' item {bad} must be a token id (an int >= 0), got {v[bad]!r}")
    return tuple(v)


def quick_subset(requests: list[TraceRequest], n: int, max_output_len: int) -> list[TraceRequest]:
    """The first n requests by arrival, each generating at most max_output_len tokens."""
    return [replace(r, output_len=min(r.output_len, max_output_len)) for r in requests[:n]]

"""StopState: what a request's stop check carries from one step to the next (Req.stops).

Its stop ids as a set, and its output text decoded and scanned for stop strings
(and stop_regex patterns) a piece at a time, so that a step's check costs O(new tokens), whatever the
number of stop ids and strings (scheduler/stop.py)."""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.utils.incremental_text import IncrementalDecoder
from radixrt.utils.stop_regex import StopRegexScan
from radixrt.utils.stop_strings import StopScan


@dataclass
class StopState:
    ids: frozenset[int]  # its stop_token_ids
    text: IncrementalDecoder | None = None  # its output's text (None: no stop strings nor stop_regex)
    scan: StopScan | None = None
    regex: StopRegexScan | None = None

    def advance(self, output_ids: list[int]) -> str | None:
        """The first stop string that ends in the text output_ids (the whole output) add since the
        last call, else the first stop_regex pattern that matches there."""
        if self.text is None:
            return None
        new = self.text.advance(output_ids)
        matched = self.scan.feed(new) if self.scan is not None else None
        if matched is None and self.regex is not None:
            matched = self.regex.feed(new)
        return matched

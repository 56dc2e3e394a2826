"""Finish checks after each sampled token: stop ids, stop strings, stop_regex, length, context.

A step's check costs O(new tokens): stop ids are a set, and stop strings are
found by an automaton fed only the text the new tokens add (Req.stops keeps
its place), never by searching a decoded tail for each string.
"""

from __future__ import annotations

from typing import Any

from radixrt.messages import FinishReason
from radixrt.scheduler.req import Req
from radixrt.scheduler.stop_state import StopState
from radixrt.utils.incremental_text import IncrementalDecoder
from radixrt.utils.stop_regex import StopRegexScan
from radixrt.utils.stop_strings import StopScan, StopStringsCache


class StopChecker:
    def __init__(self, tokenizer: Any, eos_ids: list[int], context_length: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.context_length = context_length
        self._automata = StopStringsCache()  # the n samples of a prompt share their stop list's

    def stop_ids(self, r: Req) -> list[int]:
        """Ids that end r (the worker bans them until min_new_tokens)."""
        eos = [] if r.sampling.ignore_eos else sorted(self.eos_ids)
        return eos + [i for i in r.sampling.stop_token_ids if i not in self.eos_ids]

    def check(self, r: Req, new: int = 1) -> FinishReason | None:
        """After r gained `new` output tokens (1 sampled, or more forced by its grammar)."""
        sp, tok = r.sampling, r.output_ids[-1]
        stops = r.stops if r.stops is not None else self._start(r)
        matched = stops.advance(r.output_ids)  # every step, so the text is scanned once, in order
        if r.output_len >= sp.min_new_tokens:
            if (tok in self.eos_ids and not sp.ignore_eos) or tok in stops.ids:
                return FinishReason("stop", matched=tok)
            if matched is not None:
                return FinishReason("stop", matched=matched)
        # a request under a retention policy keeps bounded KV: the context does not end it
        if r.output_len >= sp.max_new_tokens or (r.seq_len >= self.context_length and r.retention is None):
            return FinishReason("length", length=r.output_len)
        return None

    def _start(self, r: Req) -> StopState:
        sp = r.sampling
        r.stops = StopState(frozenset(sp.stop_token_ids))
        if sp.stop or sp.stop_regex:
            r.stops.text = IncrementalDecoder(self.tokenizer, sp)
        if sp.stop:
            r.stops.scan = StopScan(self._automata.get(sp.stop))
        if sp.stop_regex:
            r.stops.regex = StopRegexScan(sp.stop_regex)
        return r.stops

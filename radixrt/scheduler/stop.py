"""Finish checks after each sampled token: stop ids, stop strings, length, context."""

from __future__ import annotations

from typing import Any

from radixrt.messages import FinishReason
from radixrt.scheduler.req import Req


class StopChecker:
    def __init__(self, tokenizer: Any, eos_ids: list[int], context_length: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.context_length = context_length

    def stop_ids(self, r: Req) -> list[int]:
        """Ids that end r (the worker bans them until min_new_tokens)."""
        eos = [] if r.sampling.ignore_eos else sorted(self.eos_ids)
        return eos + [i for i in r.sampling.stop_token_ids if i not in self.eos_ids]

    def check(self, r: Req, new: int = 1) -> FinishReason | None:
        """After r gained `new` output tokens (1 sampled, or more forced by its grammar)."""
        sp, tok = r.sampling, r.output_ids[-1]
        if r.output_len >= sp.min_new_tokens:
            if (tok in self.eos_ids and not sp.ignore_eos) or tok in sp.stop_token_ids:
                return FinishReason("stop", matched=tok)
            if sp.stop:
                matched = self._stop_string(r, new)
                if matched is not None:
                    return FinishReason("stop", matched=matched)
        # a request under a retention policy keeps bounded KV: the context does not end it
        if r.output_len >= sp.max_new_tokens or (r.seq_len >= self.context_length and r.retention is None):
            return FinishReason("length", length=r.output_len)
        return None

    def _stop_string(self, r: Req, new: int) -> str | None:
        # A stop string of b bytes spans at most b tokens (every token is at
        # least one byte), plus one for a token that straddles its start; it may end
        # in any of the new tokens.
        tail_len = max(len(s.encode()) for s in r.sampling.stop) + new
        tail = self.tokenizer.decode(
            r.output_ids[-tail_len:],
            skip_special_tokens=r.sampling.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        return next((s for s in r.sampling.stop if s in tail), None)

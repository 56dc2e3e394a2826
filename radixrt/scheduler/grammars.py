"""GrammarWaitlist: requests whose output grammar is compiling, off the scheduler's loop.

A constrained request waits here (not in the waiting queue) until a small thread pool has
compiled its grammar (cached by kind and text) and made its matcher (behind a ReasoningGate
when it requires reasoning and the server has a reasoning parser); then it joins the
waiting queue like any other. The matcher is request state from then on: it stays with
the request through retraction, swap-out and re-admission, since the output so far stays.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from radixrt.constrained.grammar import GrammarCompiler, Matcher
from radixrt.constrained.reasoning_gate import ReasoningGate
from radixrt.errors import RequestError
from radixrt.messages import FinishReason
from radixrt.reasoning import get_format
from radixrt.scheduler.bad_input import bad_request, internal_error
from radixrt.scheduler.req import Req

logger = logging.getLogger(__name__)
COMPILE_THREADS = 2


class GrammarWaitlist:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], max_whitespace: int | None,
                 reasoning_end: tuple[int, ...] = ()) -> None:
        """reasoning_end: the --reasoning-parser's end marker as token ids (empty: no parser), where
        the grammar of a request that requires reasoning starts (constrained/reasoning_gate.py)."""
        self._make = lambda: GrammarCompiler(tokenizer, vocab_size, stop_ids, max_whitespace=max_whitespace)
        self.reasoning_end = reasoning_end
        self._compiler: GrammarCompiler | None = None  # made (and xgrammar loaded) on first use
        self._pool: ThreadPoolExecutor | None = None
        self.pending: list[tuple[Req, Future[Matcher | ReasoningGate]]] = []

    def __len__(self) -> int:
        return len(self.pending)

    def add(self, r: Req) -> None:
        """Start compiling r's grammar."""
        if self._pool is None:
            self._compiler = self._make()
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="radixrt-grammar")
        compiler = self._compiler
        kind, text = r.sampling.constraint
        end = self.reasoning_end if r.require_reasoning else ()

        def make() -> Matcher | ReasoningGate:
            matcher = compiler.matcher(compiler.compile(kind, text))
            return ReasoningGate(matcher, end) if end else matcher

        self.pending.append((r, self._pool.submit(make)))

    @property
    def requests(self) -> list[Req]:
        """The requests whose grammar is still compiling."""
        return [r for r, _ in self.pending]

    def remove(self, r: Req) -> None:
        """r leaves before its grammar is ready (aborted); the compile's result is dropped."""
        self.pending = [(q, f) for q, f in self.pending if q is not r]

    def take_ready(self) -> tuple[list[Req], list[tuple[Req, FinishReason]]]:
        """The requests whose compile ended: those with their matcher (set on them, they may
        wait for admission), and those it ends, with why (a refused grammar: 400; a bug: 500)."""
        done = [(r, f) for r, f in self.pending if f.done()]
        if done:
            self.pending = [(r, f) for r, f in self.pending if not f.done()]
        ready, ended = [], []
        for r, f in done:
            matcher = f.exception() or f.result()
            if isinstance(matcher, RequestError):
                ended.append((r, bad_request(matcher.message)))
            elif isinstance(matcher, BaseException):
                logger.error("compiling the grammar of %s failed: %r", r.rid, matcher)
                ended.append((r, internal_error(f"compiling the grammar failed: {type(matcher).__name__}: {matcher}")))
            else:
                r.grammar = matcher
                ready.append(r)
        return ready, ended


def reasoning_end_ids(tokenizer: Any, parser: str | None) -> tuple[int, ...]:
    """The --reasoning-parser's end marker as the tokenizer encodes it (empty without a parser)."""
    if parser is None:
        return ()
    return tuple(tokenizer.encode(get_format(parser).think_end, add_special_tokens=False))

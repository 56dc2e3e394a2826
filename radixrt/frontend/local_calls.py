"""LocalCalls: the requests of an in-process call (the Engine's) sent and waited for in plain
Python or asyncio: whole results (a progress bar over a long list), streams of cumulative
results, and prefill-only readouts. The HTTP server's counterpart is server/http_common.Submission.
"""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from radixrt.frontend.intake import PreparedCall
from radixrt.frontend.readout_calls import Prompt, readout_input
from radixrt.frontend.req_state import ReqState
from radixrt.frontend.tokenizer_manager import BackendDied, TokenizerManager
from radixrt.messages import Readout

PROGRESS_BAR_MIN = 32  # a list at least this long shows a tqdm bar
Results = dict[str, Any] | list[dict[str, Any]]


class LocalCalls:
    def __init__(self, manager: TokenizerManager, check_open: Callable[[], None]) -> None:
        """check_open: raises when the engine cannot take a call (shut down, or its backend died)."""
        self._manager, self._check_open = manager, check_open

    def generate(self, call: PreparedCall, stream: bool) -> Results | Iterator[dict[str, Any]]:
        """The call's results once all are done (one dict for a single request); stream: an
        iterator of its one request's cumulative results."""
        updates: queue.SimpleQueue[None] = queue.SimpleQueue()
        states = self._manager.submit(call, lambda: updates.put(None))
        if stream:
            return self._chunks(states[0], updates)
        bar, finished = _progress(len(states)) if call.is_batch else None, 0
        while finished < len(states):
            updates.get()
            done = sum(s.done for s in states)
            if bar is not None and done > finished:
                bar.update(done - finished)
            finished = done
        if bar is not None:
            bar.close()
        return self._results(states, call.is_batch)

    async def async_generate(self, call: PreparedCall, stream: bool) -> Results | AsyncIterator[dict[str, Any]]:
        """generate for asyncio; stream: an async iterator."""
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[None] = asyncio.Queue()
        states = self._manager.submit(call, lambda: loop.call_soon_threadsafe(updates.put_nowait, None))
        if stream:
            return self._async_chunks(states[0], updates)
        while not all(s.done for s in states):
            await updates.get()
        return self._results(states, call.is_batch)

    def readouts(self, prompts: list[Prompt], readout: Readout, is_batch: bool) -> list[ReqState]:
        """The prompts as prefill-only requests (frontend/readout_calls.py) through the door, waited
        for; a failed one raises (BackendDied once the backend is gone)."""
        self._check_open()
        updates: queue.SimpleQueue[None] = queue.SimpleQueue()
        # a score's query: prefilled once first, unless every row is needed anyway
        call = self._manager.intake.prepare(readout_input(prompts, readout, is_batch=is_batch),
                                            share_prefix=not readout.whole_prompt)
        states = self._manager.submit(call, lambda: updates.put(None))
        while not all(s.done for s in states):
            updates.get()
        for s in states:
            if s.error is not None:
                raise (BackendDied if self._manager.dead else RuntimeError)(s.error.message)
        return states

    def _results(self, states: list[ReqState], is_batch: bool) -> Results:
        results = [self._result(s) for s in states]
        return results if is_batch or len(results) > 1 else results[0]

    def _chunks(self, state: ReqState, updates: queue.SimpleQueue[None]) -> Iterator[dict[str, Any]]:
        try:
            done = False
            while not done:
                updates.get()
                done = state.done  # before reading the result: see Submission.stream in the server
                yield self._result(state)
        finally:
            if not state.done:
                self._manager.abort(state.rid)

    async def _async_chunks(self, state: ReqState, updates: asyncio.Queue[None]) -> AsyncIterator[dict[str, Any]]:
        try:
            done = False
            while not done:
                await updates.get()
                done = state.done
                yield self._result(state)
        finally:
            if not state.done:
                self._manager.abort(state.rid)

    def _result(self, state: ReqState) -> dict[str, Any]:
        if state.finish is not None and state.finish.type == "abort" and self._manager.dead:
            raise BackendDied(state.finish.message)
        return state.result(self._manager.tokenizer)


def _progress(total: int) -> Any:
    if total < PROGRESS_BAR_MIN:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")

"""Engine: the in-process entry point, with SGLang's shape.

`Engine(model_path=..., **server_args)` starts the same scheduler and worker
processes as the server, without HTTP; `generate` takes one prompt or a list.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
from typing import Any, AsyncIterator, Iterator

from radixrt.config import ServerArgs
from radixrt.frontend.req_state import ReqState
from radixrt.frontend.tokenizer_manager import BackendDied, TokenizerManager
from radixrt.sampling_params import SamplingParams
from radixrt.server.launcher import Backend

PROGRESS_BAR_MIN = 32  # a list at least this long shows a tqdm bar


class Engine:
    def __init__(self, **server_args: Any) -> None:
        self.server_args = ServerArgs.from_kwargs(**server_args)
        self._backend = Backend(self.server_args)
        try:
            self._manager = TokenizerManager(
                self.server_args, self._backend.addrs, self._backend.worker, self._backend.check_alive
            )
        except BaseException:
            self._backend.shutdown(timeout=2.0)
            raise
        self.tokenizer = self._manager.tokenizer
        self._closed = False

    # -- generation --------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_text_in_logprobs: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        batch = _is_batch(prompt, input_ids)
        if stream:
            if batch:
                raise ValueError("stream=True takes a single prompt")
            return self._stream(prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_logprobs_num, rid, return_text_in_logprobs)
        updates: queue.SimpleQueue[None] = queue.SimpleQueue()
        states = self._submit_all(
            prompt, sampling_params, input_ids, lambda: updates.put(None), return_logprob,
            logprob_start_len, top_logprobs_num, rid, return_text_in_logprobs,
        )
        bar = _progress(len(states)) if batch else None
        finished = 0
        while finished < len(states):
            updates.get()
            done = sum(s.done for s in states)
            if bar is not None:
                bar.update(done - finished)
            finished = done
        if bar is not None:
            bar.close()
        results = [self._result(s) for s in states]
        return results if batch or len(results) > 1 else results[0]

    def _stream(self, prompt, sampling_params, input_ids, return_logprob, logprob_start_len, top_n, rid, text_in_lp):
        updates: queue.SimpleQueue[None] = queue.SimpleQueue()
        states = self._submit_all(
            prompt, sampling_params, input_ids, lambda: updates.put(None), return_logprob,
            logprob_start_len, top_n, rid, text_in_lp,
        )
        if len(states) != 1:
            raise ValueError("stream=True takes n=1")
        state = states[0]

        def chunks() -> Iterator[dict[str, Any]]:
            try:
                while not state.done:
                    updates.get()
                    yield self._result(state)
            finally:
                if not state.done:
                    self._manager.abort(state.rid)

        return chunks()

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_text_in_logprobs: bool = False,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        loop = asyncio.get_running_loop()
        updates: asyncio.Queue[None] = asyncio.Queue()
        states = self._submit_all(
            prompt, sampling_params, input_ids, lambda: loop.call_soon_threadsafe(updates.put_nowait, None),
            return_logprob, logprob_start_len, top_logprobs_num, rid, return_text_in_logprobs,
        )
        if stream:
            if len(states) != 1:
                raise ValueError("stream=True takes a single prompt and n=1")
            return self._async_chunks(states[0], updates)
        while not all(s.done for s in states):
            await updates.get()
        results = [self._result(s) for s in states]
        return results if _is_batch(prompt, input_ids) or len(results) > 1 else results[0]

    async def _async_chunks(self, state: ReqState, updates: asyncio.Queue[None]) -> AsyncIterator[dict[str, Any]]:
        try:
            while not state.done:
                await updates.get()
                yield self._result(state)
        finally:
            if not state.done:
                self._manager.abort(state.rid)

    def _submit_all(self, prompt, sampling_params, input_ids, notify, return_logprob, start, top_n, rid, text_in_lp):
        self._check_open()
        prompts = _as_list(prompt) if prompt is not None else [None] * len(_as_id_lists(input_ids))
        id_lists = _as_id_lists(input_ids) if input_ids is not None else [None] * len(prompts)
        params = _per_prompt(sampling_params, len(prompts), "sampling_params")
        rids = _per_prompt(rid, len(prompts), "rid") if rid is not None else [None] * len(prompts)
        # Validate everything before sending anything: a bad item fails the whole call.
        ids = [self._manager.tokenize(p, i) for p, i in zip(prompts, id_lists)]
        sps = [SamplingParams.from_dict(p) for p in params]
        states = []
        for tokens, sp, r in zip(ids, sps, rids):
            for k in range(sp.n):
                one = _nth_sample(sp, k)
                req_rid = r if sp.n == 1 or r is None else f"{r}-{k}"
                states.append(self._manager.submit(
                    tokens, one, notify, rid=req_rid, return_logprob=return_logprob, logprob_start_len=start,
                    top_logprobs_num=top_n or 0, return_text_in_logprobs=text_in_lp,
                ))
        return states

    def _result(self, state: ReqState) -> dict[str, Any]:
        if state.finish is not None and state.finish.type == "abort" and self._manager.dead:
            raise BackendDied(state.finish.message)
        return state.result(self.tokenizer)

    def get_server_info(self) -> dict[str, Any]:
        """Server arguments and the scheduler's live counters (pool pages, queues, retractions)."""
        self._check_open()
        info: dict[str, Any] = dataclasses.asdict(self.server_args)
        info.update(self._manager.scheduler_stats())
        info["context_length"] = self._backend.worker.context_length
        return info

    # -- lifecycle ---------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        """Process ids of the scheduler and workers (for tests and operators)."""
        return self._backend.pids

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the engine is shut down")
        if self._manager.dead:
            raise BackendDied(self._manager.dead)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._manager.close()
        self._backend.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            self.shutdown()


def _is_batch(prompt: Any, input_ids: Any) -> bool:
    if prompt is not None:
        return isinstance(prompt, list)
    return isinstance(input_ids, list) and bool(input_ids) and isinstance(input_ids[0], list)


def _as_list(prompt: str | list[str]) -> list[Any]:
    return prompt if isinstance(prompt, list) else [prompt]


def _as_id_lists(input_ids: Any) -> list[Any]:
    if input_ids is None:
        raise ValueError("give exactly one of prompt (text) or input_ids")
    return input_ids if _is_batch(None, input_ids) else [input_ids]


def _per_prompt(value: Any, n: int, name: str) -> list[Any]:
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} items for {n} prompts")
        return value
    return [value] * n


def _nth_sample(sp: SamplingParams, k: int) -> SamplingParams:
    """The k-th of n parallel samples: n=1 each, distinct seeds when seeded."""
    if sp.n == 1:
        return sp
    import msgspec

    return msgspec.structs.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + k)


def _progress(total: int) -> Any:
    if total < PROGRESS_BAR_MIN:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generate", unit="req")

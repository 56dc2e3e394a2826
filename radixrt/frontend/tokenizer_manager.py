"""TokenizerManager: the front door to the scheduler.

Validates and tokenizes requests, sends them to the scheduler, and routes the
scheduler's per-step outputs to each request's state from one receiving
thread (which blocks on its socket; a one-second timeout lets it notice a dead
backend). Callers wait on their own notification, sync or async.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from typing import Callable

import zmq

from radixrt.config import ServerArgs
from radixrt.frontend.detokenizer import IncrementalDetokenizer
from radixrt.frontend.generate_input import GenerateInput
from radixrt.frontend.req_state import ReqState
from radixrt.ipc import Receiver, Sender
from radixrt.messages import (
    AbortRequest,
    ControlReply,
    ControlRequest,
    FrontendMsg,
    ReqOutput,
    SchedulerToFrontend,
    Shutdown,
    TokenizedRequest,
    WorkerReady,
)
from radixrt.sampling_params import SamplingParams
from radixrt.utils.procs import Addresses

logger = logging.getLogger(__name__)


class BackendDied(RuntimeError):
    """A scheduler or worker process exited while the frontend was running."""


class TokenizerManager:
    def __init__(
        self,
        args: ServerArgs,
        addrs: Addresses,
        worker: WorkerReady,
        check_alive: Callable[[], str | None],
        observer: Callable[[ReqState, ReqOutput], None] | None = None,
    ):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.context_length = worker.context_length
        self.vocab_size = worker.vocab_size
        self._check_alive = check_alive  # -> None, or why the backend is gone
        self._observer = observer  # sees every output before it is applied (metrics)
        self._ctx = zmq.Context()
        self._to_scheduler: Sender[FrontendMsg] = Sender(self._ctx, addrs.scheduler_in)
        self._from_scheduler: Receiver[SchedulerToFrontend] = Receiver(self._ctx, addrs.frontend_in, SchedulerToFrontend)
        self._control_waiters: dict[str, queue.SimpleQueue[ControlReply]] = {}
        self._states: dict[str, ReqState] = {}
        self._lock = threading.Lock()  # guards _states and the sender
        self.dead: str | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, name="radixrt-frontend-recv", daemon=True)
        self._thread.start()

    # -- input -----------------------------------------------------------------

    def tokenize(self, prompt: str | None, input_ids: list[int] | None) -> list[int]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt (text) or input_ids")
        if prompt is not None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            if not isinstance(input_ids, list) or not all(isinstance(i, int) for i in input_ids):
                raise ValueError("input_ids must be a list of integers")
            bad = [i for i in input_ids if not 0 <= i < self.vocab_size]
            if bad:
                raise ValueError(f"input_ids contains {bad[0]}, outside the vocabulary of {self.vocab_size}")
            ids = list(input_ids)
        if not ids:
            raise ValueError("prompt is empty")
        if len(ids) >= self.context_length:
            raise ValueError(f"prompt has {len(ids)} tokens; the context length is {self.context_length}")
        return ids

    def submit(
        self,
        ids: list[int],
        sampling: SamplingParams,
        notify: Callable[[], None],
        *,
        rid: str | None = None,
        return_logprob: bool = False,
        logprob_start_len: int | None = None,
        top_logprobs_num: int = 0,
        return_text_in_logprobs: bool = False,
        cache_salt: str | None = None,
    ) -> ReqState:
        if self.dead:
            raise BackendDied(self.dead)
        start = _logprob_start(len(ids), return_logprob, logprob_start_len, top_logprobs_num)
        rid = rid or uuid.uuid4().hex
        detok = IncrementalDetokenizer(self.tokenizer, sampling)
        state = ReqState(rid, ids, sampling, detok, notify, return_logprob, return_text_in_logprobs)
        msg = TokenizedRequest(rid, ids, sampling, return_logprob, start, top_logprobs_num, cache_salt)
        with self._lock:
            if rid in self._states:
                raise ValueError(f"rid {rid!r} is already in use")
            self._states[rid] = state
            self._to_scheduler.send(msg)
        return state

    def submit_all(self, gen: GenerateInput, notify: Callable[[], None]) -> list[ReqState]:
        """Tokenize and validate every item, then send them all (nothing is sent if one is bad)."""
        ids = [self.tokenize(item.prompt, item.input_ids) for item in gen.items]
        for tokens, item in zip(ids, gen.items):
            _logprob_start(len(tokens), item.return_logprob, item.logprob_start_len, item.top_logprobs_num)
        return [
            self.submit(
                tokens, item.sampling, notify, rid=item.rid, return_logprob=item.return_logprob,
                logprob_start_len=item.logprob_start_len, top_logprobs_num=item.top_logprobs_num,
                return_text_in_logprobs=item.return_text_in_logprobs, cache_salt=item.cache_salt,
            )
            for tokens, item in zip(ids, gen.items)
        ]

    def abort(self, rid: str) -> None:
        with self._lock:
            if rid in self._states:
                self._to_scheduler.send(AbortRequest(rid))

    def control(self, kind: str, timeout: float = 30.0) -> ControlReply:
        """Ask the scheduler ("stats" or "flush_cache") and wait for its reply."""
        if self.dead:
            raise BackendDied(self.dead)
        query_id, reply = uuid.uuid4().hex, queue.SimpleQueue()
        with self._lock:
            self._control_waiters[query_id] = reply
            self._to_scheduler.send(ControlRequest(query_id, kind))
        return reply.get(timeout=timeout)

    # -- output ----------------------------------------------------------------

    def _receive_loop(self) -> None:
        while not self._closed.is_set():
            try:
                msg = self._from_scheduler.recv(timeout_ms=1000)
            except zmq.ZMQError:
                return  # closed under us during shutdown
            if msg is None:
                if self._closed.is_set():
                    return
                why = self._check_alive()
                if why is not None:
                    self._fail_all(why)
                    return
                continue
            if isinstance(msg, ControlReply):
                self._control_waiters.pop(msg.query_id).put(msg)
                continue
            for out in msg.outputs:
                with self._lock:
                    state = self._states.get(out.rid)
                    if state is not None and out.finish is not None:
                        del self._states[out.rid]
                if state is not None:
                    if self._observer is not None:
                        self._observer(state, out)
                    state.apply(out)

    def _fail_all(self, why: str) -> None:
        logger.error("backend died: %s", why)
        self.dead = why
        with self._lock:
            states, self._states = list(self._states.values()), {}
        for s in states:
            s.fail(why)

    def close(self) -> None:
        """Ask the scheduler (and through it the workers) to stop; stop receiving."""
        self._closed.set()
        if not self.dead:
            with self._lock:
                self._to_scheduler.send(Shutdown())
        self._thread.join(timeout=5)
        self._ctx.destroy(linger=0)


def _logprob_start(prompt_len: int, return_logprob: bool, start: int | None, top_n: int) -> int:
    """Validate logprob options; without a start, one prompt logprob comes back (SGLang's default)."""
    if top_n < 0:
        raise ValueError(f"top_logprobs_num must be >= 0, got {top_n}")
    if not return_logprob:
        return -1
    if start is None or start == -1:
        return prompt_len - 1
    if not 0 <= start < prompt_len:
        raise ValueError(f"logprob_start_len must be in [0, {prompt_len}) for this prompt, got {start}")
    return start

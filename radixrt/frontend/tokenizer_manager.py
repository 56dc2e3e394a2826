"""TokenizerManager: sends prepared calls to the scheduler and tracks their requests.

A call comes in checked and tokenized (frontend/intake.py, the door, which the manager
holds for its callers); `submit` registers its requests and sends them, all or nothing,
and one receiving thread routes the scheduler's per-step outputs to each request's state
(it blocks on its socket; a one-second timeout lets it notice a dead backend). Callers
wait on their own notification, sync or async. Control calls (stats, flush_cache, weight
updates, LoRA adapters) are sent here and answered on the same thread.

Lifecycle guarantees: a call is validated whole before any of it is sent (a
refused call leaves nothing running and no rid taken); if the receiving thread
fails for any reason, every pending request and control call is failed with
the reason instead of hanging.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from typing import Any, Callable

import zmq

from radixrt.config import ServerArgs
from radixrt.errors import RequestError
from radixrt.frontend.cache_report import CacheDiagnosis
from radixrt.frontend.detokenizer import IncrementalDetokenizer
from radixrt.frontend.intake import Intake, PreparedCall, PreparedReq
from radixrt.frontend.lora_door import LoraDoor
from radixrt.frontend.req_state import ReqState
from radixrt.frontend.weights import ServedWeights, WeightUpdates
from radixrt.ipc import Receiver, Sender
from radixrt.messages import (
    AbortRequest,
    ControlQuery,
    ControlReply,
    FlushCache,
    FrontendMsg,
    GetStats,
    LoraUpdateReply,
    ReqOutput,
    SchedulerStats,
    SchedulerToFrontend,
    Shutdown,
    TokenBatchOut,
    WeightsUpdateReply,
    WorkerReady,
)
from radixrt.utils.fast_tokenizer import load_tokenizer_files
from radixrt.utils.procs import Addresses

logger = logging.getLogger(__name__)
ControlAnswer = ControlReply | WeightsUpdateReply | LoraUpdateReply


def load_tokenizer(args: ServerArgs) -> Any:
    """The served checkpoint's tokenizer (utils/fast_tokenizer.py: under a second from a tokenizer.json)."""
    return load_tokenizer_files(args.tokenizer_path or args.model_path)


class BackendDied(RuntimeError):
    """A scheduler or worker process exited while the frontend was running."""


# what the worker decided at load (WorkerReady's fields), each with its reason, for /get_server_info
WORKER_INFO = tuple(f"{name}{part}" for name in ("matmul_dtype", "weight_packing", "weight_quantization", "attention_kernels")
                    for part in ("", "_reason"))


class TokenizerManager:
    def __init__(
        self,
        args: ServerArgs,
        addrs: Addresses,
        worker: WorkerReady,
        check_alive: Callable[[], str | None],
        observer: Callable[[ReqState, ReqOutput], None] | None = None,
        model_path: str | None = None,
        tokenizer: Any | None = None,
    ):
        """args: with local directories (launch/backend.prepare_checkpoint); model_path: the checkpoint
        as the user named it (default args.model_path), which /get_model_info reports; tokenizer:
        load_tokenizer(args), when the caller loaded it already (while the processes started)."""
        self.args = args
        self._lock = threading.Lock()  # guards _states, _control_waiters, the sender and weight updates
        self._states: dict[str, ReqState] = {}
        self._control_waiters: dict[str, queue.SimpleQueue[ControlAnswer | BackendDied]] = {}
        self.weight_updates = WeightUpdates(ServedWeights(model_path or args.model_path, args.model_path,
                                                          worker.weights_fingerprint, args.weight_version),
                                            self._ask, self._lock)
        self.lora = LoraDoor(args.lora, self._ask)  # /load_lora_adapter, /unload_lora_adapter, /v1/models
        # checks, tokenizes and prepares every call before any of it is sent (its callers run it)
        self.intake = Intake(args, tokenizer if tokenizer is not None else load_tokenizer(args), worker, self.lora)
        self.tokenizer = self.intake.tokenizer
        self.worker_info = {f: getattr(worker, f) for f in WORKER_INFO}  # for /get_server_info
        # why prompts miss the prefix cache: fed with every finished request (GET /cache_report)
        self.cache_report = CacheDiagnosis(cache_enabled=not args.disable_radix_cache)
        self._check_alive = check_alive  # -> None, or why the backend is gone
        self._observer = observer  # sees every output before it is applied (metrics)
        self._ctx = zmq.Context()
        self._to_scheduler: Sender[FrontendMsg] = Sender(self._ctx, addrs.scheduler_in)
        self._from_scheduler: Receiver[SchedulerToFrontend] = Receiver(self._ctx, addrs.frontend_in, SchedulerToFrontend)
        # close() wakes the receiving thread through its own socket instead of waiting out its receive timeout
        self._wake: Sender[SchedulerToFrontend] = Sender(self._ctx, addrs.frontend_in)
        self.dead: str | None = None
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive_loop, name="radixrt-frontend-recv", daemon=True)
        self._thread.start()

    @property
    def weights(self) -> ServedWeights:
        """The weights now served (what /get_model_info and every result report)."""
        return self.weight_updates.served

    # -- input -----------------------------------------------------------------

    def submit(self, call: PreparedCall, notify: Callable[[], None]) -> list[ReqState]:
        """Send a prepared call (its shared prefix first, waited for); notify: called at every update."""
        if call.prefix is not None:
            updated: queue.SimpleQueue[None] = queue.SimpleQueue()
            [state] = self.send([call.prefix], lambda: updated.put(None))
            while not state.done:
                updated.get()
        return self.send(call.reqs, notify)

    async def submit_async(self, call: PreparedCall, notify: Callable[[], None]) -> list[ReqState]:
        """submit, its shared prefix awaited on the event loop instead."""
        if call.prefix is not None:
            loop, updated = asyncio.get_running_loop(), asyncio.Event()
            [state] = self.send([call.prefix], lambda: loop.call_soon_threadsafe(updated.set))
            while not state.done:
                await updated.wait()
                updated.clear()
        return self.send(call.reqs, notify)

    def send(self, prepared: list[PreparedReq], notify: Callable[[], None]) -> list[ReqState]:
        """Register and send prepared requests, all or nothing: a taken rid refuses the whole call."""
        if self.dead:
            raise BackendDied(self.dead)
        states, msgs = [], []
        for p in prepared:
            it = p.item
            rid = it.rid or uuid.uuid4().hex
            detok = IncrementalDetokenizer(self.tokenizer, it.sampling, p.stops)
            states.append(ReqState(rid, p.ids, it.sampling, detok, notify, it.return_logprob, it.return_text_in_logprobs,
                                   log_metrics=it.log_metrics, weight_version=self.weights.version,
                                   cache_namespace=it.namespace))
            msgs.append(p.message(rid))
        with self._lock:
            rids: set[str] = set()
            for s in states:
                if s.rid in self._states or s.rid in rids:
                    raise RequestError(f"rid {s.rid!r} is already in use", "rid")
                rids.add(s.rid)
            self._states.update((s.rid, s) for s in states)
            self.weight_updates.sent(states)
            sent = 0
            try:
                for msg in msgs:
                    self._to_scheduler.send(msg)
                    sent += 1
            except BaseException:
                for s in states:
                    del self._states[s.rid]
                for msg in msgs[:sent]:  # best effort: what did go out must not run unowned
                    self._to_scheduler.send(AbortRequest(msg.rid))
                raise
        return states

    def abort(self, rid: str) -> bool:
        """Abort rid; False when it is not pending (unknown, or already done)."""
        with self._lock:
            if rid in self._states:
                self._to_scheduler.send(AbortRequest(rid))
                return True
        return False

    def abort_all(self) -> int:
        """Abort every pending request; returns how many there were."""
        with self._lock:
            for rid in self._states:
                self._to_scheduler.send(AbortRequest(rid))
            return len(self._states)

    def fail_pending(self, why: str, status_code: int = 503) -> None:
        """Finish every pending request now with an error (graceful shutdown ran out of time)
        and tell the scheduler to drop them."""
        with self._lock:
            states, self._states = list(self._states.values()), {}
            for s in states:
                if not self.dead:
                    self._to_scheduler.send(AbortRequest(s.rid))
        for s in states:
            s.fail(why, status_code)

    def stats(self, timeout: float = 30.0) -> SchedulerStats:
        """The scheduler's live counters. Raises BackendDied when the backend is gone,
        TimeoutError when it does not answer."""
        return self._ask(GetStats, "stats", timeout).stats

    def flush_cache(self, timeout: float = 30.0) -> ControlReply:
        """Ask the scheduler to empty the prefix cache; the reply's error says why it did not.
        Raises BackendDied when the backend is gone, TimeoutError when it does not answer."""
        return self._ask(FlushCache, "flush_cache", timeout)

    def _ask(self, query: Callable[[str], ControlQuery], what: str, timeout: float | None) -> Any:
        """Send query(a fresh query id) and wait for the scheduler's reply (what: its name in the timeout error)."""
        if self.dead:
            raise BackendDied(self.dead)
        query_id, box = uuid.uuid4().hex, queue.SimpleQueue()
        with self._lock:
            msg = query(query_id)
            self._control_waiters[query_id] = box
            self._to_scheduler.send(msg)
        try:
            reply = box.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"the scheduler did not answer {what!r} within {timeout:.0f} s") from None
        finally:
            with self._lock:
                self._control_waiters.pop(query_id, None)
        if isinstance(reply, BackendDied):
            raise reply
        return reply

    # -- output ----------------------------------------------------------------

    def _receive_loop(self) -> None:
        try:
            while not self._closed.is_set():
                msg = self._from_scheduler.recv(timeout_ms=1000)
                if msg is None:
                    why = None if self._closed.is_set() else self._check_alive()
                    if why is not None:
                        self.backend_died(why)
                        return
                    continue
                self._dispatch(msg)
        except Exception as e:  # noqa: BLE001 - whatever it was, no request may hang on it
            if self._closed.is_set():
                return  # the socket was closed under us during shutdown
            logger.exception("the frontend's receiving thread failed")
            self.backend_died(f"the frontend's receiving thread failed: {type(e).__name__}: {e}")

    def _dispatch(self, msg: SchedulerToFrontend) -> None:
        if isinstance(msg, WeightsUpdateReply):
            self.weight_updates.applied(msg)
        if isinstance(msg, (ControlReply, WeightsUpdateReply, LoraUpdateReply)):
            with self._lock:
                box = self._control_waiters.get(msg.query_id)
            if box is not None:  # else its caller timed out and left
                box.put(msg)
            return
        for out in msg.outputs:
            with self._lock:
                state = self._states.get(out.rid)
                if state is not None and out.finish is not None:
                    del self._states[out.rid]
            if state is None:
                continue
            if out.finish is not None and state.log_metrics:
                try:
                    self.cache_report.observe(state.prompt_ids, out.cached_tokens, state.output_ids + out.new_ids,
                                              state.cache_namespace)
                except Exception:  # noqa: BLE001 - a diagnosis must not cost a request its answer
                    logger.exception("the cache diagnosis failed on %s", out.rid)
            if self._observer is not None and state.log_metrics:
                try:
                    self._observer(state, out)
                except Exception:  # noqa: BLE001 - metrics must not cost a request its answer
                    logger.exception("the output observer failed on %s", out.rid)
            try:
                state.apply(out)
            except Exception as e:  # noqa: BLE001
                logger.exception("applying an output to %s failed", out.rid)
                self._drop(state, f"internal error: {type(e).__name__}: {e}")

    def _drop(self, state: ReqState, why: str) -> None:
        """Fail one request whose output could not be applied, and stop it."""
        with self._lock:
            if self._states.pop(state.rid, None) is not None:
                self._to_scheduler.send(AbortRequest(state.rid))
        state.fail(why, 500)

    def backend_died(self, why: str) -> None:
        """Fail every pending request (503) and control call; nothing more is sent."""
        if self.dead is not None:
            return
        logger.error("backend died: %s", why)
        self.dead = why
        with self._lock:
            states, self._states = list(self._states.values()), {}
            waiters, self._control_waiters = list(self._control_waiters.values()), {}
        for s in states:
            s.fail(why, 503)
        for box in waiters:
            box.put(BackendDied(why))

    def close(self) -> None:
        """Ask the scheduler (and through it the workers) to stop; stop receiving."""
        self._closed.set()
        if not self.dead:
            with self._lock:
                self._to_scheduler.send(Shutdown())
        self._wake.send(TokenBatchOut([]))  # the receiving thread sees _closed at once
        self._thread.join(timeout=5)
        self.intake.close()
        self._ctx.destroy(linger=0)


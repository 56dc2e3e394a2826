"""TokenizerManager: the front door to the scheduler.

Has each call validated and tokenized (frontend/intake.py; off the caller's
thread when asked: `submit_all_async` tokenizes in a small thread pool so an
HTTP event loop never stalls on a long prompt), registers its requests and
sends them to the scheduler, and routes the scheduler's per-step outputs to
each request's state from one receiving thread (which blocks on its socket; a
one-second timeout lets it notice a dead backend). Callers wait on their own
notification, sync or async.

Lifecycle guarantees: a call is validated whole before any of it is sent (a
refused call leaves nothing running and no rid taken); if the receiving thread
fails for any reason, every pending request and control call is failed with
the reason instead of hanging.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import zmq

from radixrt.config import ServerArgs
from radixrt.errors import RequestError
from radixrt.frontend.cache_report import CacheDiagnosis
from radixrt.frontend.detokenizer import IncrementalDetokenizer
from radixrt.frontend.generate_input import GenerateInput, GenerateItem
from radixrt.frontend.intake import Intake, PreparedReq, logprob_start
from radixrt.frontend.lora_door import LoraDoor
from radixrt.frontend.readout_calls import SHARED_PREFIX_MIN_TOKENS, shared_prefix_len
from radixrt.frontend.req_state import ReqState
from radixrt.frontend.sampling_defaults import model_sampling_defaults
from radixrt.frontend.weights import ServedWeights, UpdateWeightsResult
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
    UpdateWeights,
    WeightsUpdateReply,
    WorkerReady,
)
from radixrt.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.settings.pooling import load_pooler
from radixrt.retention.rules import RetentionRules
from radixrt.sampling_params import SamplingParams
from radixrt.utils.checkpoint_meta import incompatibility
from radixrt.utils.fast_tokenizer import load_tokenizer_files
from radixrt.utils.procs import Addresses

logger = logging.getLogger(__name__)
TOKENIZE_THREADS = 4


def load_tokenizer(args: ServerArgs) -> Any:
    """The served checkpoint's tokenizer (utils/fast_tokenizer.py: under a second from a tokenizer.json)."""
    return load_tokenizer_files(args.tokenizer_path or args.model_path)


class BackendDied(RuntimeError):
    """A scheduler or worker process exited while the frontend was running."""


@dataclass
class WeightsChange:
    """A weight update the scheduler is running: what serves once it succeeds, and the requests
    sent meanwhile (they wait for it, so they will be served by the new weights)."""

    query_id: str
    weights: ServedWeights  # fingerprint filled in from the reply
    submitted: list[ReqState]


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
        self.weights = ServedWeights(model_path or args.model_path, args.model_path, worker.weights_fingerprint,
                                     args.weight_version)
        self._weights_change: WeightsChange | None = None
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(args)
        # generation_config.json's sampling values for chat requests that leave them unset (--sampling-defaults)
        self.sampling_defaults = model_sampling_defaults(Path(args.model_path), args.sampling_defaults)
        self.context_length = worker.context_length
        self.vocab_size = worker.vocab_size
        self.pooler = load_pooler(args.model_path, args.pooler_config)  # how /encode and /v1/embeddings pool
        if self.pooler.head_labels and not args.is_embedding:
            raise ValueError("this checkpoint is a sequence classifier (…ForSequenceClassification): it has no "
                             "language-model head to generate with; launch it with --is-embedding")
        # what the worker decided at load, for /get_server_info
        self.worker_info = {f: getattr(worker, f) for f in WORKER_INFO}
        # checks and tokenizes every call before any of it is sent
        self.intake = Intake(args, self.tokenizer, worker.context_length, worker.vocab_size, worker.eos_ids,
                             RetentionRules.for_worker(args.retention, worker))
        self.text_bound = self.intake.text_bound  # prompt text that could fit (the chat door holds messages to it)
        self._check_alive = check_alive  # -> None, or why the backend is gone
        self._observer = observer  # sees every output before it is applied (metrics)
        # why prompts miss the prefix cache: fed with every finished request (GET /cache_report)
        self.cache_report = CacheDiagnosis(cache_enabled=not args.disable_radix_cache)
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="radixrt-tokenize")
        self._ctx = zmq.Context()
        self._to_scheduler: Sender[FrontendMsg] = Sender(self._ctx, addrs.scheduler_in)
        self._from_scheduler: Receiver[SchedulerToFrontend] = Receiver(self._ctx, addrs.frontend_in, SchedulerToFrontend)
        # close() wakes the receiving thread through its own socket instead of waiting out its receive timeout
        self._wake: Sender[SchedulerToFrontend] = Sender(self._ctx, addrs.frontend_in)
        self._control_waiters: dict[str, queue.SimpleQueue[ControlReply | WeightsUpdateReply | LoraUpdateReply |
                                                            BackendDied]] = {}
        self._states: dict[str, ReqState] = {}
        self._lock = threading.Lock()  # guards _states, _control_waiters and the sender
        self.dead: str | None = None
        self._closed = threading.Event()
        self.lora = LoraDoor(args.lora, self._ask)  # /load_lora_adapter, /unload_lora_adapter, /v1/models
        self._thread = threading.Thread(target=self._receive_loop, name="radixrt-frontend-recv", daemon=True)
        self._thread.start()

    # -- input -----------------------------------------------------------------

    def submit(self, ids: list[int], sampling: SamplingParams, notify: Callable[[], None], *, rid: str | None = None,
               return_logprob: bool = False, logprob_start_len: int | None = None, top_logprobs_num: int = 0,
               return_text_in_logprobs: bool = False, namespace: CacheNamespace = DEFAULT_NAMESPACE) -> ReqState:
        """Send one already tokenized request as is (no door checks beyond the logprob options and
        its retention settings)."""
        item = GenerateItem(prompt=None, input_ids=ids, sampling=sampling, rid=rid, return_logprob=return_logprob,
                            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                            return_text_in_logprobs=return_text_in_logprobs, namespace=namespace)
        start = logprob_start(len(ids), return_logprob, logprob_start_len, top_logprobs_num)
        retention = self.intake.retention.resolve(sampling.kv_retention)
        return self.submit_prepared([PreparedReq(list(ids), item, start, retention=retention)], notify)[0]

    def submit_all(self, gen: GenerateInput, notify: Callable[[], None], share_prefix: bool = False) -> list[ReqState]:
        """Validate every item, then send them all (nothing is sent if one is bad); share_prefix:
        as submit_all_async's."""
        self.lora.check(gen)
        prepared = self.intake.prepare(gen)
        if share_prefix and (prefix := self._shared_prefix(prepared)) is not None:
            updated: queue.SimpleQueue[None] = queue.SimpleQueue()
            [state] = self.submit_prepared([prefix], lambda: updated.put(None))
            while not state.done:
                updated.get()
        return self.submit_prepared(prepared, notify)

    async def submit_all_async(self, gen: GenerateInput, notify: Callable[[], None],
                               share_prefix: bool = False) -> list[ReqState]:
        """submit_all with the tokenizing done in the thread pool, off the event loop. share_prefix:
        when the call's prompts share a long prefix, it is prefilled alone first (awaited), so that
        all of them find it in the radix cache instead of each computing it in the same step."""
        self.lora.check(gen)
        prepared = await asyncio.get_running_loop().run_in_executor(self._pool, self.intake.prepare, gen)
        if share_prefix and (prefix := self._shared_prefix(prepared)) is not None:
            loop, updated = asyncio.get_running_loop(), asyncio.Event()
            [state] = self.submit_prepared([prefix], lambda: loop.call_soon_threadsafe(updated.set))
            while not state.done:
                await updated.wait()
                updated.clear()
        return self.submit_prepared(prepared, notify)

    def _shared_prefix(self, prepared: list[PreparedReq]) -> PreparedReq | None:
        """A prefill-only request of the call's shared prefix, when it is long enough to be worth one."""
        n = shared_prefix_len([p.ids for p in prepared], max(SHARED_PREFIX_MIN_TOKENS, self.args.page_size))
        if not n:
            return None
        first = prepared[0]
        item = dataclasses.replace(first.item, rid=None, readout=None, log_metrics=False)
        return PreparedReq(first.ids[:n], item, -1, retention=first.retention)

    async def run_off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run other heavy input work (a chat template) in the tokenizing pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def submit_prepared(self, prepared: list[PreparedReq], notify: Callable[[], None]) -> list[ReqState]:
        """Register and send a validated call, all or nothing: a taken rid refuses the whole call."""
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
            if self._weights_change is not None:  # they wait for the update: the new weights serve them
                self._weights_change.submitted += states
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

    def update_weights_from_disk(
        self, local_path: str, model_path: str, abort_all_requests: bool = False, weight_version: str | None = None,
        timeout: float | None = None,
    ) -> UpdateWeightsResult:
        """Serve the weights of the checkpoint at local_path (model_path: as the user named it). A
        checkpoint that does not fit the running model (architecture, tensor names or shapes, read
        from headers) is refused at once; otherwise requests sent before this finish on the old
        weights (or are aborted, with abort_all_requests), later ones wait, and the call returns
        once the new weights serve (timeout None: however long the old requests take).
        weight_version (SGLang's): the label results report from now on (None: unchanged).
        Raises BackendDied, TimeoutError."""
        why = incompatibility(self.weights.local_path, local_path)
        if why is not None:
            return UpdateWeightsResult(False, f"{why}; the weights of {self.weights.model_path} keep serving")
        new = ServedWeights(model_path, local_path, "", weight_version or self.weights.version)

        def query(query_id: str) -> UpdateWeights:  # called under the lock, as the message is sent
            if self._weights_change is not None:
                raise RequestError("another weight update is in progress", "model_path")
            self._weights_change = WeightsChange(query_id, new, [])
            return UpdateWeights(query_id, local_path, abort_all_requests)

        try:
            reply = self._ask(query, "update_weights_from_disk", timeout)
        except BaseException:
            with self._lock:
                if self._weights_change is not None and self._weights_change.weights is new:
                    self._weights_change = None
            raise
        message = reply.message + (f" Weight version updated to {weight_version}." if reply.success and weight_version else "")
        return UpdateWeightsResult(reply.success, message, reply.num_paused_requests)

    def _apply_weights_change(self, reply: WeightsUpdateReply) -> None:
        """On the receiving thread, before any later output: the requests that waited for the
        update report the version that served them."""
        with self._lock:
            change = self._weights_change
            if change is None or change.query_id != reply.query_id:
                return  # a refusal of another call: the update under way is not this one
            self._weights_change = None
        if not reply.success:
            return
        self.weights = dataclasses.replace(change.weights, fingerprint=reply.weights_fingerprint)
        for s in change.submitted:
            s.weight_version = self.weights.version
        logger.info("now serving the weights of %s (fingerprint %s, version %s)", self.weights.model_path,
                    self.weights.fingerprint, self.weights.version)

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
            self._apply_weights_change(msg)
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
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._ctx.destroy(linger=0)


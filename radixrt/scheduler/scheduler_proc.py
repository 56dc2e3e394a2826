"""The scheduler process: block for requests when idle, otherwise run one step at a time."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

import zmq

from radixrt.config import ServerArgs
from radixrt.ipc import Receiver, Sender, Undecodable
from radixrt.messages import (
    AbortRequest,
    BatchResult,
    ControlReply,
    FlushCache,
    FrontendMsg,
    GetStats,
    KVMoves,
    LoadWeights,
    ReadyMsg,
    SchedulerReady,
    SchedulerToFrontend,
    SchedulerToWorker,
    Shutdown,
    SpotCheckResult,
    TokenBatchOut,
    TokenizedRequest,
    UpdateWeights,
    WeightsLoaded,
    WorkerReady,
    WorkerToScheduler,
)
from radixrt.utils.procs import Addresses, configure_child, startup_failed

if TYPE_CHECKING:  # run_scheduler imports it inside its start-up error handling
    from radixrt.scheduler.scheduler import Scheduler


def run_scheduler(args: ServerArgs, addrs: Addresses, workers_ready: Callable[[], WorkerReady], parent_pid: int) -> None:
    """The scheduler's loop. workers_ready blocks until the launcher passes on the ranks' WorkerReady:
    the imports and the tokenizer load first, while the ranks start."""
    configure_child(args, "scheduler", parent_pid)
    ctx = zmq.Context()
    ready: Sender[ReadyMsg] = Sender(ctx, addrs.ready)
    try:
        from transformers import AutoTokenizer

        from radixrt.scheduler.scheduler import Scheduler

        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
    except Exception as e:
        startup_failed(ready, "scheduler", e)
    worker = workers_ready()
    inbox: Receiver[FrontendMsg] = Receiver(ctx, addrs.scheduler_in, FrontendMsg)
    # Bound here, connected by the ranks: a send waits at most the watchdog time for a rank to be there.
    timeout_ms = int(args.watchdog_timeout * 1000)
    to_workers: list[Sender[SchedulerToWorker]] = [
        Sender(ctx, addrs.worker_in_bind(r), bind=True, timeout_ms=timeout_ms) for r in range(args.tp_size)
    ]
    from_worker: Receiver[WorkerToScheduler] = Receiver(ctx, addrs.worker_out, WorkerToScheduler)
    outbox: Sender[SchedulerToFrontend] = Sender(ctx, addrs.frontend_in)
    try:
        sched = Scheduler(args, worker, tokenizer)
    except Exception as e:
        startup_failed(ready, "scheduler", e)
    ready.send(SchedulerReady(max_total_tokens=worker.num_pages * worker.page_size))
    while True:
        # Block only when there is nothing to run (a little while when grammars compile); else take what has arrived.
        msg = receive(inbox, sched, timeout_ms=sched.poll_ms)
        while msg is not None:
            if isinstance(msg, Shutdown):
                persist = sched.mem.persist()  # the disk tier keeps what the cache holds, for the next run
                if persist:
                    send_all(to_workers, KVMoves(persist))
                send_all(to_workers, Shutdown())
                return
            if isinstance(msg, TokenizedRequest):
                sched.add_request(msg)
            elif isinstance(msg, AbortRequest):
                sched.abort(msg.rid)
            elif isinstance(msg, GetStats):
                outbox.send(ControlReply(msg.query_id, sched.stats()))
            elif isinstance(msg, FlushCache):
                error = sched.flush_cache()  # None, or why it could not (requests use the cache)
                outbox.send(ControlReply(msg.query_id, sched.stats(), error))
            elif isinstance(msg, UpdateWeights):
                refusal = sched.begin_weight_update(msg)  # later requests wait for the new weights
                if refusal is not None:
                    outbox.send(refusal)
            msg = receive(inbox, sched, timeout_ms=0)
        batch = sched.schedule()
        moves = sched.take_moves()
        if moves:  # pages the batch reads or frees move between tiers first
            send_all(to_workers, KVMoves(moves))
        if batch is not None:
            send_all(to_workers, batch)  # every rank runs every step
            sched.process(answer(from_worker, BatchResult, f"step {batch.step}", args.watchdog_timeout))
        outputs = sched.take_outputs()
        if outputs:
            outbox.send(TokenBatchOut(outputs))
        if sched.spot_check_due:  # idle: one chunk of a quality spot check, then look for requests again
            send_all(to_workers, sched.next_spot_check())
            sched.spot_checked(answer(from_worker, SpotCheckResult, "a quality spot check", args.watchdog_timeout))
        if sched.update_due:  # the old weights' last request is done
            outbox.send(update_weights(sched, to_workers, from_worker, args.watchdog_timeout))
            outputs = sched.take_outputs()  # held requests the update released may be answered at once
            if outputs:
                outbox.send(TokenBatchOut(outputs))


def update_weights(
    sched: Scheduler, to_workers: list[Sender[SchedulerToWorker]], from_worker: Receiver[WorkerToScheduler],
    timeout_s: float,
) -> SchedulerToFrontend:
    """Run a due weight update: the cached pages go to the disk tier of the old weights (a rollback
    finds them there), every rank loads, and the scheduler drops the old KV and lets the held
    requests in. Returns the reply for the frontend."""
    assert sched.update is not None
    persist = sched.mem.persist()
    if persist:
        send_all(to_workers, KVMoves(persist))
    send_all(to_workers, LoadWeights(sched.update.msg.model_path))
    return sched.finish_weight_update(answer(from_worker, WeightsLoaded, "the weight update", timeout_s))


def answer(from_worker: Receiver[WorkerToScheduler], kind: type, what: str, timeout_s: float):
    """Rank 0's answer of the expected kind; a silent or confused worker ends the scheduler (exit 3)."""
    msg = from_worker.recv(timeout_ms=int(timeout_s * 1000))
    if msg is None:
        logging.error("%s got no answer from the workers within %.0f s; giving up", what, timeout_s)
        raise SystemExit(3)
    if not isinstance(msg, kind):
        logging.error("%s got a %s from the workers, expected a %s; giving up", what, type(msg).__name__, kind.__name__)
        raise SystemExit(3)
    return msg


def receive(inbox: Receiver[FrontendMsg], sched: Scheduler, timeout_ms: int | None) -> FrontendMsg | None:
    """The next message, or None. One that does not decode is answered (when it names a rid)
    and taken for None: the loop then sends the answer and comes back for the rest."""
    try:
        return inbox.recv(timeout_ms=timeout_ms)
    except Undecodable as e:
        sched.reject_undecodable(e.raw, e.error)
        return None


def send_all(to_workers: list[Sender[SchedulerToWorker]], msg: SchedulerToWorker) -> None:
    for rank, w in enumerate(to_workers):
        try:
            w.send(msg)
        except zmq.Again:
            logging.error("worker rank %d is not connected (no peer within the watchdog timeout); giving up", rank)
            raise SystemExit(3) from None

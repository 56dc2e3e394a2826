"""The scheduler process: block for requests when idle, otherwise run one step at a time."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import zmq

from radixrt.config import ServerArgs
from radixrt.config_views import SchedulerConfig
from radixrt.ipc import Receiver, Sender, Undecodable
from radixrt.messages import (
    AbortRequest,
    BatchResult,
    Connected,
    ControlReply,
    FlushCache,
    ForwardBatch,
    FrontendMsg,
    GetStats,
    KVMove,
    KVMoves,
    LoadLora,
    LoadLoraAdapter,
    LoadWeights,
    LoraLoaded,
    ReadLora,
    ReadyMsg,
    SchedulerReady,
    SchedulerToFrontend,
    SchedulerToWorker,
    Shutdown,
    SpotCheckResult,
    TokenBatchOut,
    TokenizedRequest,
    UnloadLoraAdapter,
    UpdateWeights,
    WeightsLoaded,
    WorkerReady,
    WorkerToScheduler,
)
from radixrt.scheduler.step import step
from radixrt.utils.fast_tokenizer import load_tokenizer_files
from radixrt.utils.procs import Addresses, configure_child, startup_failed

if TYPE_CHECKING:  # run_scheduler imports it inside its start-up error handling
    from radixrt.scheduler.scheduler import Scheduler

GRAMMAR_POLL_MS = 5  # how often a scheduler with only compiling grammars looks for them


def run_scheduler(args: ServerArgs, addrs: Addresses, workers_ready: Callable[[], WorkerReady], parent_pid: int) -> None:
    """The scheduler's loop. workers_ready blocks until the launcher passes on the ranks' WorkerReady:
    the imports and the tokenizer load first, while the ranks start."""
    configure_child(args, "scheduler", parent_pid)
    ctx = zmq.Context()
    ready: Sender[ReadyMsg] = Sender(ctx, addrs.ready)
    try:
        from radixrt.scheduler.scheduler import Scheduler

        tokenizer = load_tokenizer_files(args.tokenizer_path or args.model_path)
    except Exception as e:
        startup_failed(ready, "scheduler", e)
    worker = workers_ready()
    inbox: Receiver[FrontendMsg] = Receiver(ctx, addrs.scheduler_in, FrontendMsg)
    # Bound here, connected by the ranks: a send waits at most the watchdog time for a rank to be there.
    timeout_ms = int(args.watchdog_timeout * 1000)
    to_workers: list[Sender[SchedulerToWorker]] = [
        Sender(ctx, addrs.worker_in_bind(r), bind=True, timeout_ms=timeout_ms) for r in range(args.tp_size)
    ]
    ranks = Ranks(to_workers, Receiver(ctx, addrs.worker_out, WorkerToScheduler), args.watchdog_timeout)
    outbox: Sender[SchedulerToFrontend] = Sender(ctx, addrs.frontend_in)
    try:
        sched = Scheduler(SchedulerConfig.of(args), worker, tokenizer)
    except Exception as e:
        startup_failed(ready, "scheduler", e)
    ranks.send(Connected())  # every rank's channel is up before node 0 says it is ready
    ready.send(SchedulerReady(max_total_tokens=worker.num_pages * worker.page_size))
    while True:
        # Block only when there is nothing to run (a little while when grammars compile); else take what has arrived.
        msg = receive(inbox, sched, timeout_ms=poll_ms(sched))
        while msg is not None:
            if isinstance(msg, Shutdown):
                stop_ranks(ranks, sched.mem.bridge.persist(), ctx)  # the disk tier keeps what the cache holds, for later
                return
            reply = handle(msg, sched)
            if reply is not None:
                outbox.send(reply)
            msg = receive(inbox, sched, timeout_ms=0)
        outputs = step(sched, ranks)
        if outputs:
            outbox.send(TokenBatchOut(outputs))
        if spot_check_due(sched):  # idle: one chunk of a quality spot check, then look for requests again
            run_spot_check(sched, ranks)
        if update_due(sched):  # the old weights' last request is done
            outbox.send(update_weights(sched, ranks))
            outputs = sched.take_outputs()  # held requests the update released may be answered at once
            if outputs:
                outbox.send(TokenBatchOut(outputs))


def poll_ms(sched: Scheduler) -> int | None:
    """How long the loop may block for new messages: forever when idle, not at all with work
    to run (tier moves too: a store's other servers wait for the pages the last request cached,
    or a spot check to run in idle time), a little while only grammars are compiling."""
    if sched.waiting or sched.running or sched.mem.bridge.moves_pending or spot_check_due(sched):
        return 0
    return GRAMMAR_POLL_MS if sched.queues.grammars else None


def spot_check_due(sched: Scheduler) -> bool:
    """A quality spot check's next chunk may run: it has one, and no live request waits for the workers."""
    return sched.spot.has_work and sched.idle and sched.weights.pending is None


def update_due(sched: Scheduler) -> bool:
    """A weight update waits and the old weights' requests are all done: the workers may load."""
    return sched.weights.pending is not None and sched.idle


@dataclass
class Ranks:
    """The worker ranks behind their sockets, as the step driver's worker: every rank gets every
    message, rank 0 answers; a silent or confused worker ends the scheduler (exit 3)."""

    to_workers: list[Sender[SchedulerToWorker]]
    from_worker: Receiver[WorkerToScheduler]
    timeout_s: float

    def send(self, msg: SchedulerToWorker) -> None:
        for rank, w in enumerate(self.to_workers):
            try:
                w.send(msg)
            except zmq.Again:
                logging.error("worker rank %d is not connected (no peer within the watchdog timeout); giving up", rank)
                raise SystemExit(3) from None

    def answer(self, kind: type, what: str):
        """Rank 0's answer of the expected kind."""
        msg = self.from_worker.recv(timeout_ms=int(self.timeout_s * 1000))
        if msg is None:
            logging.error("%s got no answer from the workers within %.0f s; giving up", what, self.timeout_s)
            raise SystemExit(3)
        if not isinstance(msg, kind):
            logging.error("%s got a %s from the workers, expected a %s; giving up", what, type(msg).__name__,
                          kind.__name__)
            raise SystemExit(3)
        return msg

    def move(self, moves: list[KVMove]) -> None:
        if moves:
            self.send(KVMoves(moves))

    def forward(self, batch: ForwardBatch) -> BatchResult:
        self.send(batch)  # every rank runs every step
        return self.answer(BatchResult, f"step {batch.step}")

    def read_lora(self, msg: ReadLora) -> None:
        self.send(msg)

    def load_lora(self, msg: LoadLora) -> LoraLoaded:
        self.send(msg)  # every rank reads its shards
        return self.answer(LoraLoaded, f"loading LoRA adapter {msg.adapter.name!r}")


def stop_ranks(ranks: Ranks, moves: list[KVMove], ctx: zmq.Context) -> None:
    """Send every rank the last moves, then Shutdown, and return only once zmq has written them
    (or the watchdog time has passed). NOTE: a send only queues, and the scheduler's process ends
    in os._exit (launch/child.py), which drops what zmq's I/O thread has not written yet: the
    ranks would never stop (the launcher kills them after its wait) and every page the moves
    were to write to the disk tier would be lost to the next run."""
    ranks.move(moves)
    ranks.send(Shutdown())
    for w in ranks.to_workers:
        w.sock.setsockopt(zmq.LINGER, int(ranks.timeout_s * 1000))
    ctx.destroy()  # closes every socket, then waits for theirs to be written (the others linger 0)


def run_spot_check(sched: Scheduler, ranks: Ranks) -> None:
    """Run one chunk of a due quality spot check (scheduler/spot_checks.py) on the ranks' reference pool."""
    ranks.send(sched.spot.next_message())
    res = ranks.answer(SpotCheckResult, "a quality spot check")
    sched.spot.record(res)
    sched.figures.note_memory(res.memory)


def update_weights(sched: Scheduler, ranks: Ranks) -> SchedulerToFrontend:
    """Run a due weight update: the cached pages go to the disk tier of the old weights (a rollback
    finds them there), every rank loads, and the scheduler drops the old KV and lets the held
    requests in. Returns the reply for the frontend."""
    assert sched.weights.pending is not None
    ranks.move(sched.mem.bridge.persist())
    ranks.send(LoadWeights(sched.weights.pending.msg.model_path))
    return sched.arrivals.finish_weight_update(ranks.answer(WeightsLoaded, "the weight update"))


def handle(msg: FrontendMsg, sched: Scheduler) -> SchedulerToFrontend | None:
    """What a message from the frontend does to the scheduler (Shutdown aside); the reply, if any."""
    if isinstance(msg, TokenizedRequest):
        sched.add_request(msg)
    elif isinstance(msg, AbortRequest):
        sched.abort(msg.rid)
    elif isinstance(msg, GetStats):
        return ControlReply(msg.query_id, sched.stats())
    elif isinstance(msg, FlushCache):
        error = sched.flush_cache()  # None, or why it could not (requests use the cache)
        return ControlReply(msg.query_id, sched.stats(), error)
    elif isinstance(msg, UpdateWeights):
        return sched.arrivals.begin_weight_update(msg)  # a refusal, or None: later requests wait for the new weights
    elif isinstance(msg, LoadLoraAdapter):
        return sched.lora.load(msg)
    elif isinstance(msg, UnloadLoraAdapter):
        return sched.lora.unload(msg)
    return None


def receive(inbox: Receiver[FrontendMsg], sched: Scheduler, timeout_ms: int | None) -> FrontendMsg | None:
    """The next message, or None. One that does not decode is answered (when it names a rid)
    and taken for None: the loop then sends the answer and comes back for the rest."""
    try:
        return inbox.recv(timeout_ms=timeout_ms)
    except Undecodable as e:
        sched.reject_undecodable(e.raw, e.error)
        return None

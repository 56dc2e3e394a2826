"""The worker process: receive a ForwardBatch, run it, send the BatchResult back."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq

from radixrt.config import ServerArgs
from radixrt.ipc import PeerLost, Receiver, Sender
from radixrt.messages import (
    Connected,
    ForwardBatch,
    KVMoves,
    LoadLora,
    LoadWeights,
    ReadLora,
    ReadyMsg,
    SchedulerToWorker,
    Shutdown,
    SpotCheck,
    WorkerToScheduler,
)
from radixrt.utils.procs import Addresses, configure_child, startup_failed

if TYPE_CHECKING:  # imported in run_worker, where a failure to import torch is reported as the start's failure
    from radixrt.worker.model_runner import ModelRunner


def run_worker(args: ServerArgs, addrs: Addresses, parent_pid: int, rank: int = 0) -> None:
    """One tensor-parallel rank. Every rank runs every batch; only rank 0 answers."""
    configure_child(args, f"worker{rank}", parent_pid)
    ctx = zmq.Context()
    ready: Sender[ReadyMsg] = Sender(ctx, addrs.ready)
    inbox: Receiver[SchedulerToWorker] = Receiver(
        ctx, addrs.worker_in_for(rank), SchedulerToWorker, bind=False, watch_peer=addrs.multi_node
    )
    outbox: Sender[WorkerToScheduler] | None = Sender(ctx, addrs.worker_out) if rank == 0 else None
    try:
        from radixrt.worker.model_runner import ModelRunner

        runner = ModelRunner(args, rank, addrs.dist_init)
    except Exception as e:
        startup_failed(ready, f"worker {rank}", e)
    ready.send(runner.ready_message())
    while True:
        try:
            msg = inbox.recv()
        except PeerLost as e:  # a rank on another node outlives node 0 only this long
            logging.error("worker %d lost the scheduler at %s; exiting", rank, e)
            raise SystemExit(1)
        if isinstance(msg, Shutdown):
            if runner.tiers is not None:
                runner.tiers.close()
            return
        if isinstance(msg, Connected):  # the scheduler's check that this channel is up
            continue
        if isinstance(msg, KVMoves):
            runner.move(msg.moves)
            continue
        if isinstance(msg, ReadLora):  # a background read: the loop goes on
            runner.lora.read(msg.adapter)
            continue
        reply = _serve(rank, *_work(runner, msg))
        if outbox is not None:
            outbox.send(reply)


def _work(runner: ModelRunner, msg: SchedulerToWorker) -> tuple[Callable[[], WorkerToScheduler], str]:
    """What to run for a message that rank 0 answers, and what a failure of it leaves unknown."""
    if isinstance(msg, LoadWeights):  # every rank or none: an exception is a failed rollback, part old, part new
        return lambda: runner.load_weights(msg.model_path), "could not restore its weights after a failed update"
    if isinstance(msg, LoadLora):
        return lambda: runner.load_lora(msg), f"failed loading LoRA adapter {msg.adapter.name!r}"
    if isinstance(msg, SpotCheck):
        return lambda: runner.spot_check(msg), f"failed running spot check {msg.check_id}"
    assert isinstance(msg, ForwardBatch)
    # one request's failure comes back in result.errors; an exception is the model forward or the KV pool's
    return lambda: runner.forward(msg), f"failed running step {msg.step}"


def _serve(rank: int, run: Callable[[], WorkerToScheduler], failure: str) -> WorkerToScheduler:
    """run's reply; an exception out of it leaves the device state unknown: the worker exits."""
    try:
        return run()
    except Exception:
        logging.exception("worker %d %s; exiting", rank, failure)
        raise SystemExit(1) from None

"""The worker process: receive a ForwardBatch, run it, send the BatchResult back."""

from __future__ import annotations

import logging

import zmq

from radixrt.config import ServerArgs
from radixrt.ipc import PeerLost, Receiver, Sender
from radixrt.messages import (
    ForwardBatch, KVMoves, LoadWeights, ReadyMsg, SchedulerToWorker, Shutdown, SpotCheck, WorkerToScheduler
)
from radixrt.utils.procs import Addresses, configure_child, startup_failed


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
            return
        if isinstance(msg, KVMoves):
            runner.move(msg.moves)
            continue
        if isinstance(msg, LoadWeights):
            try:
                loaded = runner.load_weights(msg.model_path)  # every rank or none
            except Exception:  # the rollback to the old weights failed: the model is part old, part new
                logging.exception("worker %d could not restore its weights after a failed update; exiting", rank)
                raise SystemExit(1) from None
            if outbox is not None:
                outbox.send(loaded)
            continue
        if isinstance(msg, SpotCheck):
            try:
                checked = runner.spot_check(msg)
            except Exception:  # the reference forward itself: the device state is unknown
                logging.exception("worker %d failed running spot check %d; exiting", rank, msg.check_id)
                raise SystemExit(1) from None
            if outbox is not None:
                outbox.send(checked)
            continue
        assert isinstance(msg, ForwardBatch)
        try:
            result = runner.forward(msg)  # one request's failure comes back in result.errors
        except Exception:  # the model forward or the KV pool: the device state is unknown
            logging.exception("worker %d failed running step %d; exiting", rank, msg.step)
            raise SystemExit(1) from None
        if outbox is not None:
            outbox.send(result)

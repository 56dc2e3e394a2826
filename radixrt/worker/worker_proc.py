"""The worker process: receive a ForwardBatch, run it, send the BatchResult back."""

from __future__ import annotations

import logging

import zmq

from radixrt.config import ServerArgs
from radixrt.ipc import Receiver, Sender
from radixrt.messages import BatchResult, ChildFailed, ForwardBatch, ReadyMsg, SchedulerToWorker, Shutdown
from radixrt.utils.procs import Addresses, configure_child


def run_worker(args: ServerArgs, addrs: Addresses, parent_pid: int) -> None:
    configure_child(args, "worker", parent_pid)
    ctx = zmq.Context()
    ready: Sender[ReadyMsg] = Sender(ctx, addrs.ready)
    inbox: Receiver[SchedulerToWorker] = Receiver(ctx, addrs.worker_in, SchedulerToWorker)
    outbox: Sender[BatchResult] = Sender(ctx, addrs.worker_out)
    try:
        from radixrt.worker.model_runner import ModelRunner

        runner = ModelRunner(args)
    except Exception as e:
        logging.exception("worker failed to start")
        ready.send(ChildFailed(who="worker", error=f"{type(e).__name__}: {e}"))
        raise SystemExit(1)
    ready.send(runner.ready_message())
    while True:
        msg = inbox.recv()
        if isinstance(msg, Shutdown):
            return
        assert isinstance(msg, ForwardBatch)
        outbox.send(runner.forward(msg))

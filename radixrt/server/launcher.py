"""Backend: starts the worker and scheduler processes, waits for them to be ready,
notices when one dies, and stops them all. No other module knows how many
processes exist.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import socket
import tempfile
import time

import zmq

from radixrt.config import ServerArgs
from radixrt.ipc import Receiver
from radixrt.messages import ChildFailed, ReadyMsg, SchedulerReady, WorkerReady
from radixrt.scheduler.scheduler_proc import run_scheduler
from radixrt.utils.procs import Addresses
from radixrt.worker.worker_proc import run_worker

logger = logging.getLogger(__name__)
START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Backend:
    """This node's processes: its tensor-parallel ranks, and on node 0 the scheduler.

    With nnodes > 1, node k runs ranks [k * tp / nnodes, (k + 1) * tp / nnodes); they
    meet node 0's ranks at dist_init_addr and take their steps from node 0's scheduler.
    """

    def __init__(self, args: ServerArgs) -> None:
        self._dir = tempfile.mkdtemp(prefix="radixrt-")
        dist_init = args.dist_init_addr or f"127.0.0.1:{free_port() if args.tp_size > 1 else 0}"
        self.addrs = Addresses.in_dir(self._dir, dist_init, multi_node=args.nnodes > 1)
        self._ctx = zmq.Context()
        self._ready: Receiver[ReadyMsg] = Receiver(self._ctx, self.addrs.ready, ReadyMsg)
        self.processes: list[mp.process.BaseProcess] = []
        spawn = mp.get_context("spawn")
        per_node = args.tp_size // args.nnodes
        ranks = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)
        try:
            for rank in ranks:
                self._start(spawn, f"radixrt-worker-{rank}", run_worker, (args, self.addrs, os.getpid(), rank))
            # every rank reports; they agreed on one pool, so any report describes them all
            self.worker: WorkerReady = [self._wait_ready(WorkerReady) for _ in ranks][0]
            if args.node_rank == 0:
                self._start(spawn, "radixrt-scheduler", run_scheduler, (args, self.addrs, self.worker, os.getpid()))
                self._wait_ready(SchedulerReady)
        except BaseException:
            self.shutdown(timeout=2.0)
            raise

    def _start(self, spawn, name: str, target, args: tuple) -> None:
        p = spawn.Process(target=target, args=args, name=name, daemon=True)
        p.start()
        self.processes.append(p)

    def _wait_ready(self, kind: type) -> ReadyMsg:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            msg = self._ready.recv(timeout_ms=500)
            if isinstance(msg, ChildFailed):
                raise RuntimeError(f"{msg.who} failed to start: {msg.error}")
            if isinstance(msg, kind):
                return msg
            why = self.check_alive()
            if why is not None:
                raise RuntimeError(f"{why} while starting; see its log above")
        raise TimeoutError(f"{kind.__name__} did not arrive within {START_TIMEOUT_S} s")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes if p.pid is not None]

    def check_alive(self) -> str | None:
        """None while every child runs; else which one exited, and how."""
        for p in self.processes:
            if p.exitcode is not None:
                return f"{p.name} (pid {p.pid}) exited with code {p.exitcode}"
        return None

    def shutdown(self, timeout: float = 10.0) -> None:
        """Wait for the children to exit (after a Shutdown message), then force them."""
        deadline = time.monotonic() + timeout
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                logger.warning("%s did not stop in time; killing it", p.name)
                p.kill()
                p.join(5)
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)

"""Backend: starts the worker and scheduler processes, waits for them to be ready,
notices when one dies, and stops them all. No other module knows how many
processes exist. prepare_checkpoint is the preflight both entry points (the server's
main and the Engine) run before starting anything; the Backend and the tokenizer
manager take the args it returns (local directories), the user-facing parts keep
the typed ones.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import zmq

from radixrt.config import ServerArgs
from radixrt.frontend.sampling_defaults import model_sampling_defaults
from radixrt.ipc import Receiver
from radixrt.launch import child
from radixrt.launch.ports import free_port
from radixrt.launch.process import START_TIMEOUT_S, Process, StartupError
from radixrt.launch.worker_env import find_tcmalloc, worker_env
from radixrt.messages import ChildFailed, ReadyMsg, SchedulerReady, WorkerReady
from radixrt.model_source import resolve_model_source
from radixrt.utils.procs import Addresses

logger = logging.getLogger(__name__)


def prepare_checkpoint(args: ServerArgs) -> ServerArgs:
    """The args the processes run with: model_path and tokenizer_path as local directories
    (a Hugging Face repo id resolved through the cache, model_source.py), the model's
    generation_config.json sampling defaults checked. Starts nothing; raises ValueError
    naming the argument."""
    local = resolve_model_source(args)
    model_sampling_defaults(Path(local.model_path), local.sampling_defaults)  # a bad generation_config.json: here
    return local


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
        self.processes: list[Process] = []
        per_node = args.tp_size // args.nnodes
        ranks = range(args.node_rank * per_node, (args.node_rank + 1) * per_node)
        try:
            # NOTE: started from this (the main) thread: the children's PR_SET_PDEATHSIG
            # fires when the thread that started them exits.
            for rank in ranks:
                self._start(f"radixrt-worker-{rank}", "worker", args, rank=rank)
            # the scheduler imports and loads its tokenizer while the ranks start; then it gets their report
            scheduler = self._start("radixrt-scheduler", "scheduler", args) if args.node_rank == 0 else None
            # every rank reports; they agreed on one pool, so any report describes them all
            self.worker: WorkerReady = [self._wait_ready(WorkerReady) for _ in ranks][0]
            if scheduler is not None:
                scheduler.send(child.encode(self.worker))
                self._wait_ready(SchedulerReady)
        except BaseException:  # the ones already up wait for steps that never come: stop them now
            for p in self.processes:
                p.kill()
            self.shutdown(timeout=2.0)
            raise

    def _start(self, name: str, role: child.Role, args: ServerArgs, rank: int = 0) -> Process:
        spec = child.ChildSpec(role, args, self.addrs, os.getpid(), list(sys.path), rank=rank)
        env = None
        if role == "worker":
            tcmalloc = find_tcmalloc()
            logger.info("%s allocator: %s", name, tcmalloc or "glibc, keeping freed memory (no tcmalloc found)")
            env = worker_env(tcmalloc=tcmalloc)
        proc = Process(name, child.command(), env, stdin=True)
        # the scheduler's stdin stays open for one more frame: the ranks' WorkerReady
        proc.send(child.encode(spec), last=role != "scheduler")
        self.processes.append(proc)
        return proc

    def _wait_ready(self, kind: type) -> ReadyMsg:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            msg = self._ready.recv(timeout_ms=500)
            if isinstance(msg, ChildFailed):
                raise StartupError(f"{msg.who} failed to start: {msg.error}")
            if isinstance(msg, kind):
                return msg
            why = self.check_alive()
            if why is not None:
                raise StartupError(f"{why} while starting; see its log above")
        raise StartupError(f"{kind.__name__} did not arrive within {START_TIMEOUT_S} s")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

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
            p.wait(deadline - time.monotonic())
        for p in self.processes:
            if p.exitcode is None:
                logger.warning("%s did not stop in time; killing it", p.name)
                p.kill()
        self._ctx.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


def start_serving(args: ServerArgs) -> tuple[Backend, Any]:
    """Node 0's processes, started, and the frontend's tokenizer: loaded in a thread while the
    processes start (the main thread only waits for their reports then), where it used to take its
    seconds after them. The processes are stopped if the tokenizer fails to load."""
    from radixrt.frontend.tokenizer_manager import load_tokenizer

    with ThreadPoolExecutor(1, thread_name_prefix="radixrt-tokenizer") as pool:
        tokenizer = pool.submit(load_tokenizer, args)
        backend = Backend(args)  # NOTE: from the main thread (the children die with the thread that started them)
        try:
            return backend, tokenizer.result()
        except BaseException:
            backend.shutdown(timeout=2.0)
            raise

"""`launch_server --dp-size N`: N radixrt servers (replicas) behind SGLang's router.

This module is the parent process of that deployment. It owns no model:

  * it splits the machine between the replicas (replicas.py);
  * it starts each replica as `python -m radixrt.launch_server --dp-size 1` on a
    loopback port, in a process group of its own (Ctrl-C in a terminal reaches only
    this parent) that dies with this process, and waits for every /health;
  * it starts `python -m sglang_router.launch_router` (router.py) on the public
    host:port and waits until the router lists every replica as healthy (its /workers);
  * it watches them: one exiting stops the others (exit 1, the log names it);
    SIGINT/SIGTERM stop the router first (no new requests), then the replicas, which
    drain their requests and stop their own processes (exit 0).
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from types import TracebackType

from radixrt.config import ServerArgs
from radixrt.launch.ports import bind, free_ports
from radixrt.launch.process import START_TIMEOUT_S, Process, StartupError
from radixrt.launch.replicas import Share, replica_args, replica_command, split_machine
from radixrt.launch.router import POLICIES, check_router, healthy, local_url, router_command, router_ready

logger = logging.getLogger("radixrt.server")
POLL_S = 0.2
STOP_MARGIN_S = 10.0  # beyond graceful_shutdown_timeout, for a replica to stop its own processes


class StartInterrupted(Exception):
    """SIGINT or SIGTERM arrived while the replicas or the router were starting."""


def preflight(args: ServerArgs) -> list[Share]:
    """The replicas' shares of the machine, after checking that the router is installed and the
    arguments fit a data-parallel deployment. Starts nothing; ValueError names the problem."""
    check_router()
    if args.nnodes > 1:
        raise ValueError("dp_size > 1 runs every replica on this node: it cannot be combined with nnodes > 1")
    if args.port == 0:
        raise ValueError("dp_size > 1 needs a fixed port for the router (port 0 picks none that clients could know)")
    return split_machine(args)


class DataParallelServer:
    """The replicas and the router of one deployment. Entering starts them (everything started
    is stopped again if that fails); serve() watches them; leaving stops them all.

    replica_urls are the replicas' own loopback URLs (their /get_server_info counts each one's
    cached tokens); url is the router's, the one clients use. `stop` set (by a signal handler)
    interrupts start() with StartInterrupted and ends serve().
    """

    def __init__(self, args: ServerArgs, policy: str = "cache_aware", stop: threading.Event | None = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {policy!r}")
        self.args, self.policy = args, policy
        self.shares = preflight(args)
        self.url = local_url(args.host, args.port)
        self.replicas: list[Process] = []
        self.replica_urls: list[str] = []
        self.router: Process | None = None
        self._stop = stop or threading.Event()

    def __enter__(self) -> DataParallelServer:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, kind: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()

    def start(self) -> None:
        bind(self.args.host, self.args.port).close()  # fail now, before the replicas load, if the router could not bind
        *ports, metrics_port = free_ports(len(self.shares) + 1)
        for rank, (share, port) in enumerate(zip(self.shares, ports)):
            self._start_replica(rank, share, port)
        for proc, url in zip(self.replicas, self.replica_urls):
            self._wait_until(functools.partial(healthy, url), f"{proc.name} to answer {url}/health")
        router = router_command(self.args, self.replica_urls, self.policy, metrics_port)
        self.router = Process("the router", router, own_group=True)
        logger.info("router: pid %d, policy %s, at %s (its metrics on port %d)", self.router.pid, self.policy, self.url, metrics_port)
        ready = functools.partial(router_ready, self.url, self.args.api_key, len(self.replicas))
        self._wait_until(ready, f"the router to list {len(self.replicas)} healthy replicas at {self.url}/workers")

    def _start_replica(self, rank: int, share: Share, port: int) -> None:
        args = replica_args(self.args, port, on_cpu=not share.gpus)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(share.gpus)) if share.gpus else None
        proc = Process(f"replica {rank}", replica_command(args), env, own_group=True, cores=share.cores)
        self.replicas.append(proc)
        self.replica_urls.append(local_url(args.host, port))
        logger.info("replica %d: pid %d at %s on %s", rank, proc.pid, self.replica_urls[-1], share.describe())

    def _wait_until(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            dead = self.exited()
            if dead is not None:
                raise StartupError(f"{dead.name} (pid {dead.pid}) exited with code {dead.exitcode} while starting; see its log above")
            if self._stop.wait(POLL_S):
                raise StartInterrupted(f"interrupted while waiting for {what}")
            if time.monotonic() > deadline:
                raise StartupError(f"timed out after {START_TIMEOUT_S} s waiting for {what}")

    def exited(self) -> Process | None:
        """The first started process that is no longer running, if any."""
        procs = self.replicas + ([self.router] if self.router else [])
        return next((p for p in procs if p.exitcode is not None), None)

    def serve(self) -> int:
        """Watch until `stop` is set (0) or a process exits (1, logged)."""
        while not self._stop.wait(POLL_S):
            dead = self.exited()
            if dead is not None:
                logger.error("%s (pid %d) exited with code %s; stopping the router and the replicas", dead.name, dead.pid, dead.exitcode)
                return 1
        return 0

    def stop(self) -> None:
        """The router first (it stops taking requests and drains), then every replica; a process
        that outstays its grace is killed with its whole process group."""
        grace, start = self.args.graceful_shutdown_timeout + STOP_MARGIN_S, time.monotonic()
        if self.router is not None:
            self.router.terminate()
            if not self.router.wait(grace):
                logger.warning("the router did not stop in time; killing it")
                self.router.kill()
        logger.info("router stopped after %.1f s; stopping %d replicas", time.monotonic() - start, len(self.replicas))
        for proc in self.replicas:
            proc.terminate()
        deadline = time.monotonic() + grace
        for proc in self.replicas:
            if not proc.wait(deadline - time.monotonic()):
                logger.warning("%s did not stop in time; killing its process group", proc.name)
                proc.kill()
        logger.info("stopped after %.1f s", time.monotonic() - start)


def run_data_parallel(args: ServerArgs) -> int:
    """launch_server's main for dp_size > 1: 0 after SIGINT/SIGTERM, 1 when a process died,
    130 when interrupted while starting. StartupError (one line) when one could not start."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with DataParallelServer(args, "cache_aware", stop) as dp:
            print(f"radixrt server ready at {dp.url} (model {args.model_name}; {len(dp.replicas)} replicas"
                  f" behind sglang_router, policy {dp.policy})", flush=True)
            return dp.serve()
    except StartInterrupted:
        return 130

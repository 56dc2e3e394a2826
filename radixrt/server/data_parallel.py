"""`launch_server --dp-size N`: N radixrt servers (replicas) behind SGLang's router.

SGLang's router (the `sglang_router` package, `radixrt[router]`) with `--policy
cache_aware` keeps an approximate radix tree of the text it sent to each replica and
sends a request to the replica that holds the longest prefix of it (the least loaded
one when the loads drift apart), so a prefix keeps meeting the radix cache that
computed it. This module is the parent process of that deployment. It owns no model:

  * it splits the machine: on CPU each replica gets a disjoint share of this
    process's cores (its affinity mask; the replica's worker uses them as its
    threads), on CUDA tp_size GPUs of CUDA_VISIBLE_DEVICES each;
  * it starts each replica as `python -m radixrt.launch_server --dp-size 1` on a
    loopback port, in a process group of its own (Ctrl-C in a terminal reaches only
    this parent) that dies with this process, and waits for every /health;
  * it starts `python -m sglang_router.launch_router` on the public host:port and
    waits until the router lists every replica as healthy (its /workers);
  * it watches them: one exiting stops the others (exit 1, the log names it);
    SIGINT/SIGTERM stop the router first (no new requests), then the replicas, which
    drain their requests and stop their own processes (exit 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from radixrt.config import ServerArgs
from radixrt.server.launcher import START_TIMEOUT_S, StartupError
from radixrt.utils.procs import die_with_parent, free_ports

logger = logging.getLogger("radixrt.server")
ROUTER_INSTALL = 'pip install "radixrt[router]" (or pip install sglang-router)'
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
ROUTER_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}
POLL_S = 0.2
STOP_MARGIN_S = 10.0  # beyond graceful_shutdown_timeout, for a replica to stop its own processes


class StartInterrupted(Exception):
    """SIGINT or SIGTERM arrived while the replicas or the router were starting."""


@dataclass(frozen=True)
class Share:
    """What one replica may use: CPU cores (on CPU) or GPU ids for CUDA_VISIBLE_DEVICES (on CUDA)."""

    cores: tuple[int, ...] = ()
    gpus: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"GPUs {','.join(self.gpus)}" if self.gpus else f"cores {','.join(map(str, self.cores))}"


# -- preflight: what can be checked before anything starts (ValueError names the problem) --


def check_router() -> None:
    """Raise ValueError, saying how to install it, unless SGLang's router can be imported."""
    try:
        import sglang_router.router  # noqa: F401  (the Rust core; launch_router wraps it)
    except ImportError as e:
        raise ValueError(f"dp_size > 1 runs SGLang's router, which cannot be imported ({e}): {ROUTER_INSTALL}") from None


def preflight(args: ServerArgs) -> list[Share]:
    """The replicas' shares of the machine, after checking that the router is installed and the
    arguments fit a data-parallel deployment."""
    check_router()
    if args.nnodes > 1:
        raise ValueError("dp_size > 1 runs every replica on this node: it cannot be combined with nnodes > 1")
    if args.port == 0:
        raise ValueError("dp_size > 1 needs a fixed port for the router (port 0 picks none that clients could know)")
    return split_machine(args)


def split_machine(args: ServerArgs) -> list[Share]:
    if _uses_cuda(args):
        return split_gpus(_visible_gpus(), args.dp_size, args.tp_size)
    return split_cores(sorted(os.sched_getaffinity(0)), args.dp_size)


def split_cores(cores: list[int], replicas: int) -> list[Share]:
    """Disjoint, contiguous, near-equal runs of cores, one per replica."""
    n = len(cores)
    if n < replicas:
        raise ValueError(f"dp_size {replicas} needs a core per replica; this process may run on {n} ({cores})")
    return [Share(cores=tuple(cores[r * n // replicas : (r + 1) * n // replicas])) for r in range(replicas)]


def split_gpus(gpus: list[str], replicas: int, tp_size: int) -> list[Share]:
    """tp_size GPUs per replica, in order."""
    if len(gpus) < replicas * tp_size:
        raise ValueError(
            f"dp_size {replicas} x tp_size {tp_size} needs {replicas * tp_size} GPUs; {len(gpus)} are visible ({gpus})"
        )
    return [Share(gpus=tuple(gpus[r * tp_size : (r + 1) * tp_size])) for r in range(replicas)]


def _uses_cuda(args: ServerArgs) -> bool:
    """What the replicas' workers will pick (model_runner.resolve_device)."""
    if args.device != "auto":
        return args.device == "cuda"
    import torch

    return torch.cuda.is_available()


def _visible_gpus() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if visible:
        return [g.strip() for g in visible.split(",") if g.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


# -- command lines ----------------------------------------------------------------------


def server_flags(args: ServerArgs) -> list[str]:
    """The launch_server command line that gives back `args` (fields at their default left out)."""
    out: list[str] = []
    for f in dataclasses.fields(ServerArgs):
        value = getattr(args, f.name)
        if value == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        out += [flag] if value is True else [flag, str(value)]
    return out


def replica_args(args: ServerArgs, port: int, on_cpu: bool) -> ServerArgs:
    """One replica's arguments: on loopback at `port`, serving alone. On CPU the replicas share
    the host's memory, so each sizes its KV pool from its share of mem_fraction_static."""
    changes: dict[str, object] = {"host": "127.0.0.1", "port": port, "dp_size": 1}
    if on_cpu and args.max_total_tokens is None:
        from radixrt.worker.kv_pool import CPU_DEFAULT_FRACTION

        changes["mem_fraction_static"] = (args.mem_fraction_static or CPU_DEFAULT_FRACTION) / args.dp_size
    return dataclasses.replace(args, **changes)


def router_command(args: ServerArgs, worker_urls: list[str], policy: str, metrics_port: int) -> list[str]:
    """SGLang's router on the public host:port, in front of worker_urls."""
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port", str(args.port),
        "--worker-urls", *worker_urls, "--policy", policy, "--log-level", ROUTER_LOG_LEVELS.get(args.log_level, "info"),
        "--prometheus-host", args.host, "--prometheus-port", str(metrics_port),
        "--max-payload-size", str(args.max_request_bytes),
        "--shutdown-grace-period-secs", str(max(1, round(args.graceful_shutdown_timeout))),
    ]
    return cmd + (["--api-key", args.api_key] if args.api_key else [])


# -- processes --------------------------------------------------------------------------


class Proc:
    """A started command in a process group of its own, killed (SIGKILL) when this process dies:
    a replica's own processes die with it in turn, so nothing outlives the parent."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str] | None = None, cores: tuple[int, ...] = ()) -> None:
        self.name = name
        parent = os.getpid()

        def in_child() -> None:  # between fork and exec; the death signal survives the exec
            die_with_parent(parent)
            if cores:
                os.sched_setaffinity(0, cores)

        # NOTE: started from the main thread: PR_SET_PDEATHSIG fires when the starting *thread* exits.
        self.popen = subprocess.Popen(cmd, env=env, process_group=0, preexec_fn=in_child)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def terminate(self) -> None:
        """SIGTERM to the leader only: it stops its own children in order."""
        if self.exitcode is None:
            self.popen.terminate()

    def wait(self, timeout: float) -> bool:
        """True once it has exited."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(max(0.0, timeout))
        return self.exitcode is not None

    def kill_group(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        self.popen.wait()


def _get(url: str, api_key: str | None = None, timeout: float = 2.0) -> tuple[int, bytes]:
    """Status and body of a GET (with the api key, when there is one); (0, b"") when nothing answers."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return 0, b""


def _healthy(url: str) -> bool:
    return _get(url + "/health")[0] == 200


def _url(host: str, port: int) -> str:
    """http://host:port to connect to; a wildcard bind address is reached on loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def check_port_free(host: str, port: int) -> None:
    """Fail now, before the replicas load, when the router could not bind host:port."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise StartupError(f"cannot bind {host}:{port}: {e.strerror}") from None


# -- the deployment ---------------------------------------------------------------------


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
        self.url = _url(args.host, args.port)
        self.replicas: list[Proc] = []
        self.replica_urls: list[str] = []
        self.router: Proc | None = None
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
        check_port_free(self.args.host, self.args.port)
        *ports, metrics_port = free_ports(len(self.shares) + 1)
        for rank, (share, port) in enumerate(zip(self.shares, ports)):
            self._start_replica(rank, share, port)
        for proc, url in zip(self.replicas, self.replica_urls):
            self._wait_until(functools.partial(_healthy, url), f"{proc.name} to answer {url}/health")
        router = router_command(self.args, self.replica_urls, self.policy, metrics_port)
        self.router = Proc("the router", router)
        logger.info("router: pid %d, policy %s, at %s (its metrics on port %d)", self.router.pid, self.policy, self.url, metrics_port)
        self._wait_until(self._router_ready, f"the router to list {len(self.replicas)} healthy replicas at {self.url}/workers")

    def _start_replica(self, rank: int, share: Share, port: int) -> None:
        args = replica_args(self.args, port, on_cpu=not share.gpus)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(share.gpus)) if share.gpus else None
        proc = Proc(f"replica {rank}", [sys.executable, "-m", "radixrt.launch_server", *server_flags(args)], env, share.cores)
        self.replicas.append(proc)
        self.replica_urls.append(_url(args.host, port))
        logger.info("replica %d: pid %d at %s on %s", rank, proc.pid, self.replica_urls[-1], share.describe())

    def _router_ready(self) -> bool:
        """Every replica registered with the router and healthy (its /readiness would say 503,
        logged as an error, until then; /workers says it quietly)."""
        status, body = _get(self.url + "/workers", self.args.api_key)  # the router asks for the key too
        return status == 200 and sum(w.get("is_healthy", False) for w in json.loads(body)["workers"]) == len(self.replicas)

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

    def exited(self) -> Proc | None:
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
                self.router.kill_group()
        logger.info("router stopped after %.1f s; stopping %d replicas", time.monotonic() - start, len(self.replicas))
        for proc in self.replicas:
            proc.terminate()
        deadline = time.monotonic() + grace
        for proc in self.replicas:
            if not proc.wait(deadline - time.monotonic()):
                logger.warning("%s did not stop in time; killing its process group", proc.name)
                proc.kill_group()
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

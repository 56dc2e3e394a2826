"""The children's entry point: what a worker rank or the scheduler runs first.

The launcher starts each child as `python -c "from radixrt.server.child import main; main()"`
and writes one msgpack-encoded ChildSpec to its stdin. Unlike multiprocessing's spawn, this
never re-imports the caller's `__main__` (so `radixrt.Engine(...)` works at the top level of a
plain script) and pickles nothing. This module owns the spec and its decoding; the process
loops stay in run_worker and run_scheduler.
"""

from __future__ import annotations

import signal
import sys
from typing import Literal

import msgspec

from radixrt.config import ServerArgs
from radixrt.messages import WorkerReady
from radixrt.utils.procs import Addresses

Role = Literal["worker", "scheduler"]
BOOTSTRAP = "from radixrt.server.child import main; main()"  # also how tests tell our children apart


class ChildSpec(msgspec.Struct, frozen=True):
    """Everything one child needs, sent once by the launcher."""

    role: Role
    args: ServerArgs
    addrs: Addresses
    parent_pid: int
    sys_path: list[str]  # the parent's: the child imports what the parent would
    rank: int = 0  # the worker's tensor-parallel rank
    worker: WorkerReady | None = None  # the scheduler's view of the ranks (role "scheduler" only)


def command() -> list[str]:
    """argv of a child; its spec goes to stdin."""
    return [sys.executable, "-c", BOOTSTRAP]


def encode(spec: ChildSpec) -> bytes:
    return msgspec.msgpack.encode(spec)


def main() -> None:
    # The launcher stops children; a terminal's Ctrl-C (sent to the whole process group)
    # must not interrupt one while it is still importing. configure_child keeps this.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    data = sys.stdin.buffer.read()
    if not data:  # the parent died before sending the spec
        raise SystemExit(1)
    spec = msgspec.msgpack.decode(data, type=ChildSpec)
    # NOTE: `-c` put the cwd first on sys.path; a folder there (the repo's kernels/, say)
    # could shadow a package that transformers probes. Import the rest as the parent does.
    sys.path[:] = spec.sys_path
    if spec.role == "worker":
        from radixrt.worker.worker_proc import run_worker

        run_worker(spec.args, spec.addrs, spec.parent_pid, spec.rank)
    else:
        from radixrt.scheduler.scheduler_proc import run_scheduler

        assert spec.worker is not None, "the scheduler's spec carries the workers' WorkerReady"
        run_scheduler(spec.args, spec.addrs, spec.worker, spec.parent_pid)

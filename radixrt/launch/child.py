"""The children's entry point: what a worker rank or the scheduler runs first.

The Backend starts each child as `python -c "from radixrt.launch.child import main; main()"`
and writes one msgpack-encoded ChildSpec to its stdin, as a length-prefixed frame. The scheduler
starts beside the worker ranks and gets a second frame, their WorkerReady, once they are up:
it spends the ranks' start-up importing and loading its tokenizer instead of waiting for them.
Unlike multiprocessing's spawn, this never re-imports the caller's `__main__` (so
`radixrt.Engine(...)` works at the top level of a plain script) and pickles nothing. This module
owns the spec, the frames and their decoding; the process loops stay in run_worker and run_scheduler.
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import sys
from typing import Any, BinaryIO, Literal

import msgspec

from radixrt.config import ServerArgs
from radixrt.messages import WorkerReady
from radixrt.utils.procs import Addresses

Role = Literal["worker", "scheduler"]
BOOTSTRAP = "from radixrt.launch.child import main; main()"  # also how tests tell our children apart


class ChildSpec(msgspec.Struct, frozen=True):
    """Everything one child needs, sent once by the launcher."""

    role: Role
    args: ServerArgs
    addrs: Addresses
    parent_pid: int
    sys_path: list[str]  # the parent's: the child imports what the parent would
    rank: int = 0  # the worker's tensor-parallel rank


def command() -> list[str]:
    """argv of a child; its spec goes to stdin."""
    return [sys.executable, "-c", BOOTSTRAP]


def encode(msg: ChildSpec | WorkerReady) -> bytes:
    """One stdin frame: a 4-byte big-endian length, then the msgpack message."""
    data = msgspec.msgpack.encode(msg)
    return struct.pack(">I", len(data)) + data


def read_frame(stream: BinaryIO, kind: type) -> Any:
    """The next frame from the launcher, decoded as kind. A launcher that died before sending it
    (end of input) ends this child."""
    head = stream.read(4)
    if len(head) < 4:
        raise SystemExit(1)
    (n,) = struct.unpack(">I", head)
    data = stream.read(n)
    if len(data) < n:
        raise SystemExit(1)
    return msgspec.msgpack.decode(data, type=kind)


def main() -> None:
    # The launcher stops children; a terminal's Ctrl-C (sent to the whole process group)
    # must not interrupt one while it is still importing. configure_child keeps this.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec: ChildSpec = read_frame(sys.stdin.buffer, ChildSpec)
    # NOTE: `-c` put the cwd first on sys.path; a folder there could shadow a package the
    # parent imported from elsewhere. Import the rest as the parent does.
    sys.path[:] = spec.sys_path
    if spec.role == "worker":
        from radixrt.worker.worker_proc import run_worker

        run_worker(spec.args, spec.addrs, spec.parent_pid, spec.rank)
    else:
        from radixrt.scheduler.scheduler_proc import run_scheduler

        run_scheduler(spec.args, spec.addrs, lambda: read_frame(sys.stdin.buffer, WorkerReady), spec.parent_pid)
    # A clean stop: everything it owed was sent (the disk tier written) before its loop returned.
    # Skip the interpreter's teardown of torch, transformers and zmq (about half a second per child).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

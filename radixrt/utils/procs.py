"""Process plumbing the children share with their launcher: their addresses, their setup, and how one
reports that it could not start. Starting and watching processes is radixrt/launch/."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from radixrt.config import ServerArgs
from radixrt.ipc import Sender
from radixrt.messages import ChildFailed, ReadyMsg

PR_SET_PDEATHSIG = 1
# Start-up failures that are the user's (a missing file, an unsupported model or value):
# logged in one line. Anything else is a bug and keeps its traceback.
USER_ERRORS = (OSError, ValueError)


@dataclass(frozen=True)
class Addresses:
    """Endpoints of one node's processes. Each ipc:// endpoint is bound by its
    receiver, except the scheduler -> worker channels, which the scheduler binds
    (so ranks on other nodes can reach node 0 knowing only dist_init_addr)."""

    scheduler_in: str  # frontend -> scheduler
    worker_in: str  # scheduler -> worker rank r: worker_in_for(r)
    worker_out: str  # worker rank 0 -> scheduler
    frontend_in: str  # scheduler -> frontend
    ready: str  # children -> this node's launcher
    dist_init: str = ""  # torch.distributed rendezvous of the tensor-parallel ranks (tcp://host:port)

    @classmethod
    def in_dir(cls, d: str | Path, dist_init_addr: str, multi_node: bool = False) -> Addresses:
        """Node-local ipc endpoints; with multi_node, the worker channels are tcp ports of
        node 0 just above dist_init_addr's (port + 1 + rank)."""
        names = ("scheduler_in", "worker_in", "worker_out", "frontend_in", "ready")
        addrs = {n: f"ipc://{Path(d) / n}" for n in names}
        if multi_node:
            addrs["worker_in"] = f"tcp://{dist_init_addr}"
        return cls(**addrs, dist_init=f"tcp://{dist_init_addr}")

    @property
    def multi_node(self) -> bool:
        return self.worker_in.startswith("tcp://")

    def worker_in_for(self, rank: int) -> str:
        """Where worker `rank` connects for its steps."""
        if self.multi_node:
            host, port = self.worker_in.removeprefix("tcp://").rsplit(":", 1)
            return f"tcp://{host}:{int(port) + 1 + rank}"
        return f"{self.worker_in}_{rank}"

    def worker_in_bind(self, rank: int) -> str:
        """Where the scheduler binds rank's channel (every interface, on tcp)."""
        addr = self.worker_in_for(rank)
        return f"tcp://*:{addr.rsplit(':', 1)[1]}" if self.multi_node else addr


def configure_child(args: ServerArgs, name: str, parent_pid: int) -> None:
    """Logging; SIGINT ignored (the launcher stops children, so Ctrl-C reaches the parent
    only); and death with the parent, so a killed parent leaves no orphans."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {name}[{os.getpid()}] %(levelname)s %(message)s",
    )


def die_with_parent(parent_pid: int) -> None:
    # NOTE: PR_SET_PDEATHSIG fires when the *thread* that started us exits, so
    # the launcher must start children from a long-lived thread (the main one).
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return  # not Linux: rely on the launcher's shutdown
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)


def startup_failed(ready: Sender[ReadyMsg], who: str, e: Exception) -> NoReturn:
    """Log why `who` could not start, tell the launcher (which reports it in one line), exit 1."""
    reason = " ".join(f"{type(e).__name__}: {e}".split())  # one line, even from a multi-line message
    if isinstance(e, USER_ERRORS):
        logging.error("%s failed to start: %s", who, reason)
    else:
        logging.exception("%s failed to start", who)
    ready.send(ChildFailed(who=who, error=reason))
    raise SystemExit(1)


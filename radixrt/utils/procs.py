"""Process plumbing shared by the children: their addresses and their setup."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from dataclasses import dataclass
from pathlib import Path

from radixrt.config import ServerArgs

PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Addresses:
    """ipc:// endpoints; each is bound by its receiver."""

    scheduler_in: str  # frontend -> scheduler
    worker_in: str  # scheduler -> worker rank r: worker_in_for(r)
    worker_out: str  # worker rank 0 -> scheduler
    frontend_in: str  # scheduler -> frontend
    ready: str  # children -> launcher
    dist_init: str = ""  # torch.distributed rendezvous of the tensor-parallel ranks

    @classmethod
    def in_dir(cls, d: str | Path, dist_port: int = 0) -> Addresses:
        names = ("scheduler_in", "worker_in", "worker_out", "frontend_in", "ready")
        return cls(*(f"ipc://{Path(d) / n}" for n in names), dist_init=f"tcp://127.0.0.1:{dist_port}")

    def worker_in_for(self, rank: int) -> str:
        return f"{self.worker_in}_{rank}"


def configure_child(args: ServerArgs, name: str, parent_pid: int) -> None:
    """Logging; SIGINT ignored (the launcher stops children, so Ctrl-C reaches the parent
    only); and death with the parent, so a killed parent leaves no orphans."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent(parent_pid)
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s {name}[{os.getpid()}] %(levelname)s %(message)s",
    )


def _die_with_parent(parent_pid: int) -> None:
    # NOTE: PR_SET_PDEATHSIG fires when the *thread* that started us exits, so
    # the launcher must start children from a long-lived thread (the main one).
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return  # not Linux: rely on the launcher's shutdown
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)

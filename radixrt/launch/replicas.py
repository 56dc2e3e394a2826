"""The replicas of a data-parallel deployment (`launch_server --dp-size N`): each one's share of
the machine, and the launch_server command line each runs.

On CPU each replica gets a disjoint share of this process's cores (its affinity mask; the
replica's worker uses them as its threads), on CUDA tp_size GPUs of CUDA_VISIBLE_DEVICES each.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from dataclasses import dataclass

from radixrt.config import ServerArgs


@dataclass(frozen=True)
class Share:
    """What one replica may use: CPU cores (on CPU) or GPU ids for CUDA_VISIBLE_DEVICES (on CUDA)."""

    cores: tuple[int, ...] = ()
    gpus: tuple[str, ...] = ()

    def describe(self) -> str:
        return f"GPUs {','.join(self.gpus)}" if self.gpus else f"cores {','.join(map(str, self.cores))}"


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


def replica_command(args: ServerArgs) -> list[str]:
    """A replica is a radixrt server of its own."""
    return [sys.executable, "-m", "radixrt.launch_server", *server_flags(args)]

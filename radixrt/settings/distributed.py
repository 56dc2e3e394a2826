"""Many processes, GPUs or servers: tensor-parallel ranks and the nodes they span, data-parallel
replicas behind the cache-aware router, and CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.settings.fields import arg, check_at_least


@dataclass(frozen=True)
class DistributedArgs:
    tp_size: int = arg(1, "tensor parallel ranks (worker processes; gloo on CPU, NCCL on CUDA)")
    nnodes: int = arg(1, "nodes the tensor-parallel ranks span (tp_size / nnodes ranks per node)")
    node_rank: int = arg(0, "this node's index; node 0 runs the scheduler and the HTTP server")
    dist_init_addr: str | None = arg(None, "host:port of node 0 where the nodes meet (required when nnodes > 1)")
    dp_size: int = arg(1, "data-parallel server replicas behind sglang_router (cache_aware) on the public port")
    # The router's own names (sglang_router.launch_server spells them --router-*). Only the absolute
    # balance floor differs from sglang_router's default (64): see docs/architecture.md, data parallelism.
    router_cache_threshold: float = arg(
        0.3, "with dp_size > 1: a request goes to the replica whose routed text shares the longest prefix with it "
        "when that prefix is more than this fraction of its text; otherwise (a cache miss) to the least loaded one"
    )
    router_balance_abs_threshold: int = arg(
        2, "with dp_size > 1: the replicas count as imbalanced, and a request goes to the least loaded one whatever "
        "its prefix, when the busiest has more than this many requests in flight over the idlest (and "
        "router_balance_rel_threshold holds too); sglang_router's default is 64"
    )
    router_balance_rel_threshold: float = arg(
        1.5, "with dp_size > 1: imbalanced also needs the busiest replica's requests in flight to exceed this "
        "multiple of the idlest's (>= 1)"
    )
    cuda_graph_max_bs: int = arg(256, "largest decode batch run from a captured CUDA graph")
    disable_cuda_graph: bool = arg(False, "run decode eagerly instead of from captured CUDA graphs")

    def check(self) -> None:
        check_at_least(self, ("tp_size", "nnodes", "dp_size"), 1)
        if not 0 <= self.router_cache_threshold <= 1:
            raise ValueError(f"router_cache_threshold must be in [0, 1], got {self.router_cache_threshold}")
        check_at_least(self, ("router_balance_abs_threshold",), 0)
        check_at_least(self, ("router_balance_rel_threshold",), 1)
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr (host:port of node 0) is required when nnodes > 1")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65535:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        check_at_least(self, ("cuda_graph_max_bs",), 1)

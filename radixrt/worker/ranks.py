"""Ranks: what the tensor-parallel ranks agree on before they act.

Each method is a collective: every rank calls it, in the same order, with its own value,
and gets the same answer. With one rank each returns what it was given.
"""

from __future__ import annotations

import torch

from radixrt.models.cpu_matmul import MatmulChoice
from radixrt.models.parallel import TPGroup


class Ranks:
    def __init__(self, tp: TPGroup, device: torch.device) -> None:
        self.tp, self.device = tp, device

    def reduce_each(self, values: list[int], op: torch.distributed.ReduceOp) -> list[int]:
        """values reduced elementwise with op over the ranks (every rank passes as many, in the same order)."""
        if self.tp.size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=op)
        return t.tolist()

    def reduce(self, value: int, op: torch.distributed.ReduceOp) -> int:
        return self.reduce_each([value], op)[0]

    def share(self, values: list[int]) -> list[int]:
        """Rank 0's values on every rank (every rank passes as many)."""
        if self.tp.size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        torch.distributed.broadcast(t, src=0)
        return t.tolist()

    def first_failed(self, failed: bool) -> int | None:
        """The lowest rank that failed (every rank passes its own flag), or None."""
        # the lowest failed rank r sends the largest value, size - r
        top = self.reduce(self.tp.size - self.tp.rank if failed else 0, torch.distributed.ReduceOp.MAX)
        return self.tp.size - top if top else None

    def fewest(self, num_pages: int) -> int:
        """Every rank must hold the same pages: the smallest pool any rank can afford."""
        return self.reduce(num_pages, torch.distributed.ReduceOp.MIN)

    def matmul(self, choice: MatmulChoice) -> MatmulChoice:
        """Every rank computes as the others do: float32 if any rank chose it (ranks of one host
        read the same flags, so they differ only where a measurement overrode them)."""
        upcast = self.reduce(int(choice.dtype == torch.float32), torch.distributed.ReduceOp.MAX)
        if upcast and choice.dtype != torch.float32:
            return MatmulChoice(torch.float32, f"another rank's choice ({choice.reason} here)")
        return choice

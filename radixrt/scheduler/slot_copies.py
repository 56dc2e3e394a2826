"""SlotCopies: the KV slot copies the worker makes before the next batch (copy-on-write).

A request never writes a page the prefix cache holds: where it must (a partially matching page it
goes on from, or, at a retention drop, every cache page it still reads), it takes a page of its
own and the worker copies the slots over first. KVMemory and KVRetention note the copies here;
the scheduler takes them with each batch.
"""

from __future__ import annotations


class SlotCopies:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.src: list[int] = []  # slot i of the next batch's copies goes from src[i] to dst[i]
        self.dst: list[int] = []

    def add(self, src_page: int, dst_page: int, n: int) -> None:
        """Copy the first n slots of src_page into dst_page."""
        ps = self.page_size
        self.src += range(src_page * ps, src_page * ps + n)
        self.dst += range(dst_page * ps, dst_page * ps + n)

    def take(self) -> tuple[list[int], list[int]]:
        """The copies so far (sources, destinations), for the next batch; none are left."""
        out = (self.src, self.dst)
        self.src, self.dst = [], []
        return out

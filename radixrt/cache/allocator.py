"""PageAllocator: the free list of KV page ids.

Invariant (checked by tests after every workload): every page is either free
here, owned by a running request, or held by the prefix cache, and the three
add up to the pool.

Pages come out in ascending order, a run at a time where the free list holds one: the
attention kernel reads a request's pages in order, and on a 2-core AVX2 EPYC it read
ascending runs 1.4-2.3x faster than the same runs descending, as a stack handed them out
before (the hardware prefetchers follow an ascending stream across page boundaries).
"""

from __future__ import annotations

from array import array


class OutOfPages(Exception):
    """alloc() was asked for more pages than are free."""


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # A stack of free ids (4 bytes each, so millions of pages stay cheap), its top the
        # lowest id of the run there: page 0 is handed out first.
        self._free = array("i", range(num_pages - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        if n == 0:
            return []
        pages = self._free[-n:].tolist()
        del self._free[-n:]
        pages.reverse()  # the top first: a run ascending
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))  # a run freed comes back out as it went
        assert len(self._free) <= self.num_pages, "a page was freed twice"

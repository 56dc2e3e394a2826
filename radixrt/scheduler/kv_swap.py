"""KVSwap: preemption by swapping, on KVMemory's side (--preemption-mode swap or auto).

A retracted request's KV is parked in host slots reserved for it (KVTiers' host half:
host_tier.py) and comes back into fresh pages of its own when it is admitted again; an aborted
one frees its slots. It writes the request's KVHandle swap state (swap_slots, swapped_len).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from radixrt.scheduler.kv_tiers import KVTiers
from radixrt.scheduler.req import Req


class KVSwap:
    def __init__(self, tiers: KVTiers | None, page_size: int, alloc: Callable[[int], list[int]]) -> None:
        """alloc(n): n free device pages (KVMemory.alloc: evicting cache leaves if it must)."""
        self.tiers, self.page_size, self.alloc = tiers, page_size, alloc

    def out(self, r: Req) -> bool:
        """Park r's KV in host memory before it is released; False if it does not fit."""
        kv = r.kv
        pages = kv.pages[: math.ceil(kv.kv_len / self.page_size)]
        slots = self.tiers.host_tier.swap_out(pages) if self.tiers is not None and pages else None
        if slots is None:
            return False
        kv.swap_slots, kv.swapped_len = slots, kv.kv_len
        return True

    def pages_back(self, r: Req, n: int) -> int:
        """Pages a swapped-out r needs to come back and run n more tokens."""
        return math.ceil((r.kv.swapped_len + n) / self.page_size)

    def back(self, r: Req) -> None:
        """Bring a swapped-out r's KV back into fresh pages of its own."""
        kv = r.kv
        pages = self.alloc(len(kv.swap_slots))
        self.tiers.host_tier.swap_in(kv.swap_slots, pages)
        kv.reset(pages, kv.swapped_len)
        kv.clear_swap()

    def drop(self, r: Req) -> None:
        """A swapped-out r leaves without coming back (aborted): free its host slots."""
        self.tiers.host.release(r.kv.swap_slots)
        r.kv.clear_swap()

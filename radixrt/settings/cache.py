"""The prefix cache: whether KV is reused across requests, the order cached pages leave, and how
much of it requests may pin (cache_control)."""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.settings.fields import arg

EVICTION_POLICIES = ("lru", "lfu", "cost")  # radixrt/cache/eviction.py


@dataclass(frozen=True)
class CacheArgs:
    disable_radix_cache: bool = arg(False, "do not reuse KV across requests (every prompt is computed in full)")
    radix_eviction_policy: str = arg(
        "lru", "the order cached KV pages leave the device pool and the host and disk tiers (always leaves first): "
        "lru (least recently used), lfu (fewest hits, then least recently used) or cost (hits weighted by what the "
        "pages cost to recompute, aged greedy-dual style)"
    )
    max_pinned_fraction: float = arg(
        0.25, "pages that requests may pin with cache_control (kept cached for a TTL), as a fraction of the device "
        "KV pool plus the host tier; a pin past it is refused with a 400 (0: no pins)"
    )
    max_pinned_namespace_fraction: float = arg(
        1.0, "the pinned pages one cache namespace (cache_salt) may hold, as a fraction of the pin budget"
    )

    def check(self) -> None:
        if self.radix_eviction_policy not in EVICTION_POLICIES:
            raise ValueError(f"radix_eviction_policy must be lru, lfu or cost, got {self.radix_eviction_policy!r}")
        for name in ("max_pinned_fraction", "max_pinned_namespace_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be between 0 and 1, got {getattr(self, name)}")

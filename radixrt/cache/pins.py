"""PinTable: which pages a request asked to keep cached for a time (`cache_control` with a ttl).

A pin names pages by content key (cache/tier_index.page_keys), so it holds wherever the page is:
on the device, in host memory or on disk, or not computed yet (a pin taken at the door reserves
its budget before its request runs). A pinned page is evicted only after every unpinned one and
is never dropped before its TTL: it may move down a tier (KVMemory and KVTiers do that part).

The budget: at most `capacity` pages pinned in all (`--max-pinned-fraction` of the device pool
plus the host tier), and each cache namespace at most `namespace_capacity` of them. A pin past
either is refused whole, with the budget named (refusal()); pinning a page again only extends
its TTL and takes no more budget. Time is the caller's clock (time.monotonic in the scheduler).
Plain Python.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass, field


@dataclass
class PinTable:
    capacity: int  # pages pinned at most, in all namespaces
    namespace_capacity: int  # pages pinned at most in one namespace
    until: dict[str, float] = field(default_factory=dict)  # pinned key -> when its pin ends
    namespace_of: dict[str, str] = field(default_factory=dict)  # pinned key -> its namespace id
    per_namespace: Counter = field(default_factory=Counter)  # namespace id -> pinned pages
    tenant_of: dict[str, str] = field(default_factory=dict)  # pinned key -> the tenant that pinned it first
    per_tenant: Counter = field(default_factory=Counter)  # tenant -> pinned pages (its KV quota counts them)
    _heap: list[tuple[float, str]] = field(default_factory=list)  # (until when filed, key): one per pinned key
    pins_taken: int = 0  # requests whose pin was granted
    pins_refused: int = 0
    pages_expired: int = 0

    def __contains__(self, key: str) -> bool:
        return key in self.until

    def __len__(self) -> int:
        return len(self.until)

    def refusal(self, keys: list[str], namespace: str, tenant: str = "", quota: int | None = None) -> str | None:
        """Why pinning keys in the namespace (id) for tenant, whose KV quota is `quota` pages (None:
        none), would pass a budget (None: it would not)."""
        new = sum(1 for key in dict.fromkeys(keys) if key not in self.until)
        if quota is not None and self.per_tenant[tenant] + new > quota:
            return (f"cache_control: pinning {len(keys)} pages ({new} not pinned yet) would pass tenant {tenant!r}'s "
                    f"KV quota of {quota} pages (--tenant-kv-quota, or its kv_quota in --api-keys-file; "
                    f"{self.per_tenant[tenant]} pinned now)")
        if len(self.until) + new > self.capacity:
            return (f"cache_control: pinning {len(keys)} pages ({new} not pinned yet) would pass the pin budget of "
                    f"{self.capacity} pages (--max-pinned-fraction of the device KV pool plus the host tier; "
                    f"{len(self.until)} pinned now)")
        if self.per_namespace[namespace] + new > self.namespace_capacity:
            return (f"cache_control: pinning {len(keys)} pages ({new} not pinned yet) would pass this cache "
                    f"namespace's pin budget of {self.namespace_capacity} pages (--max-pinned-namespace-fraction "
                    f"of the pin budget; {self.per_namespace[namespace]} pinned now)")
        return None

    def pin(self, keys: list[str], namespace: str, until: float, tenant: str = "") -> list[str]:
        """Pin keys until `until` (a later pin of a key extends it); returns the keys newly pinned.
        Check refusal() first."""
        new = []
        for key in dict.fromkeys(keys):
            if key not in self.until:
                new.append(key)
                self.namespace_of[key] = namespace
                self.per_namespace[namespace] += 1
                self.tenant_of[key] = tenant
                self.per_tenant[tenant] += 1
                self.until[key] = until
                heapq.heappush(self._heap, (until, key))  # one entry per key: an extension re-files it at expiry
            elif until > self.until[key]:
                self.until[key] = until
        self.pins_taken += 1
        return new

    def expire(self, now: float) -> list[str]:
        """Unpin every key whose pin ended by `now`; returns them."""
        out = []
        while self._heap and self._heap[0][0] <= now:
            _, key = heapq.heappop(self._heap)
            until = self.until.get(key)
            if until is None:  # unpinned meanwhile (clear)
                continue
            if until > now:  # a later pin extended it: filed again at its new end
                heapq.heappush(self._heap, (until, key))
            else:
                out.append(key)
                self._unpin(key)
        self.pages_expired += len(out)
        return out

    def clear(self, keys: list[str] | None = None) -> list[str]:
        """Unpin keys (all when None: a flush, a weight update); returns those that were pinned."""
        out = [key for key in (list(self.until) if keys is None else keys) if key in self.until]
        for key in out:
            self._unpin(key)
        if keys is None:
            self._heap.clear()
        return out

    def _unpin(self, key: str) -> None:
        del self.until[key]
        ns = self.namespace_of.pop(key)
        self.per_namespace[ns] -= 1
        if not self.per_namespace[ns]:
            del self.per_namespace[ns]
        tenant = self.tenant_of.pop(key)
        self.per_tenant[tenant] -= 1
        if not self.per_tenant[tenant]:
            del self.per_tenant[tenant]

    def stats(self) -> dict[str, int]:
        return {"pinned_pages": len(self.until), "pin_budget_pages": self.capacity,
                "pinned_namespaces": len(self.per_namespace), "pins_taken": self.pins_taken,
                "pins_refused": self.pins_refused, "pinned_pages_expired": self.pages_expired}

"""Where a request's cached prompt tokens came from, tier by tier (SGLang's cached_tokens_details).

At its first admission a request's KV starts with what the device radix tree matched (a
partially matching page's copied slots included) and the pages KVMemory loaded back from
host memory and disk; the device's share is the rest of what it reused.
"""

from __future__ import annotations

from radixrt.messages import CachedTokensDetail
from radixrt.scheduler.kv_handle import TierLoad
from radixrt.scheduler.kv_tiers import KVTiers


def cached_details(cached: int, loaded: TierLoad, page_size: int, tiers: KVTiers | None) -> CachedTokensDetail | None:
    """cached (the tokens reused at first admission) by tier, given what that admission loaded;
    None without the hierarchical cache or without a hit, as SGLang has it. storage is there
    when the server has a disk tier (or the pages came from one that has failed since)."""
    if tiers is None or not tiers.cache_on_host or cached <= 0:
        return None
    host, disk = loaded.host_pages * page_size, loaded.disk_pages * page_size
    assert host + disk <= cached, f"loaded {host + disk} tokens from the tiers of {cached} reused"
    storage = disk if tiers.disk is not None or tiers.store is not None or disk else None
    return CachedTokensDetail(device=cached - host - disk, host=host, storage=storage,
                              storage_backend="mooncake" if tiers.store is not None else "file")

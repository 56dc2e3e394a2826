"""KV memory bookkeeping (pure Python, no tensors): which page belongs to whom.

Every page is free in the PageAllocator, owned by a running request, or held
by the prefix cache (RadixCache, or NoPrefixCache when caching is off).
"""

from radixrt.cache.allocator import OutOfPages, PageAllocator
from radixrt.cache.disabled import NoPrefixCache
from radixrt.cache.radix_cache import InsertResult, MatchResult, Node, RadixCache

PrefixCache = RadixCache | NoPrefixCache

__all__ = ["InsertResult", "MatchResult", "NoPrefixCache", "Node", "OutOfPages", "PageAllocator", "PrefixCache", "RadixCache"]

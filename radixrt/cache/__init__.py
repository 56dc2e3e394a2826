"""KV memory bookkeeping (pure Python, no tensors): which page belongs to whom.

Every page is free in the PageAllocator, owned by a running request, or held
by the prefix cache: RadixCache, or NoPrefixCache when caching is off, both
keeping the PrefixCache contract (prefix_cache.py).
"""

from radixrt.cache.allocator import OutOfPages, PageAllocator
from radixrt.cache.disabled import NoPrefixCache
from radixrt.cache.prefix_cache import InsertResult, MatchResult, Node, PrefixCache
from radixrt.cache.radix_cache import RadixCache

__all__ = ["InsertResult", "MatchResult", "NoPrefixCache", "Node", "OutOfPages", "PageAllocator", "PrefixCache", "RadixCache"]

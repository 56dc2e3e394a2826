"""KV memory bookkeeping (pure Python, no tensors): which page belongs to whom."""

from radixrt.cache.allocator import OutOfPages, PageAllocator

__all__ = ["OutOfPages", "PageAllocator"]

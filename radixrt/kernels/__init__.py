"""radixrt.kernels: attention backends over the paged KV cache, and small fused ops.

Imports torch only (FlashInfer lazily, on CUDA). Backends come from a registry by
name (`create_attention_backend`).
"""

from radixrt.kernels.backend import AttentionBackend, AttentionMetadata, LayerAttention
from radixrt.kernels.kv_cache import PagedKVCache
from radixrt.kernels.registry import ATTENTION_BACKENDS, create_attention_backend, default_attention_backend

__all__ = [
    "ATTENTION_BACKENDS",
    "AttentionBackend",
    "AttentionMetadata",
    "LayerAttention",
    "PagedKVCache",
    "create_attention_backend",
    "default_attention_backend",
]

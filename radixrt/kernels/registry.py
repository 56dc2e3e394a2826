"""Attention backends by name (`--attention-backend`)."""

from __future__ import annotations

from typing import Callable
from typing import Sequence

from radixrt.kernels.backend import AttentionBackend, LayerAttention
from radixrt.kernels.kv_cache import PagedKVCache


def _torch(cache: PagedKVCache, num_heads: int, head_dim: int, layers: Sequence[LayerAttention]) -> AttentionBackend:
    from radixrt.kernels.torch_backend import TorchBackend

    return TorchBackend(cache, num_heads, head_dim, layers)


def _flashinfer(cache: PagedKVCache, num_heads: int, head_dim: int, layers: Sequence[LayerAttention]) -> AttentionBackend:
    from radixrt.kernels.flashinfer_backend import FlashInferBackend

    return FlashInferBackend(cache, num_heads, head_dim, layers)


ATTENTION_BACKENDS: dict[str, Callable[..., AttentionBackend]] = {"torch": _torch, "flashinfer": _flashinfer}


def default_attention_backend(device_type: str) -> str:
    return "flashinfer" if device_type == "cuda" else "torch"


def create_attention_backend(
    name: str, cache: PagedKVCache, num_heads: int, head_dim: int, layers: Sequence[LayerAttention]
) -> AttentionBackend:
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend {name!r} is unknown; choose one of {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name](cache, num_heads, head_dim, layers)

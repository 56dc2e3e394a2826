"""Decode attention on CPU: one query token per request over its gathered KV, in float32.

The torch path where the compiled kernel (native_attention.py) cannot build or the
pool is quantized (decodes, and the shared-prefix half of cascade decoding), and the
explicit scores a soft-capped layer's prefill needs there (torch_backend.capped_prefill). Grouped matmuls, not
scaled_dot_product_attention: with one query row and bf16 K/V, SDPA's CPU
kernels are 2.6-6x slower than two batched matmuls and a softmax over the same
data; in fp32 they are even (bench/attention_cpu.py measures both over batch,
KV length, head_dim, GQA group, page size and dtype). The query heads that share a KV head
are stacked as rows of one matmul, so K and V are read once per KV head, not
once per query head. Everything runs in float32 whatever the pool holds: half
precision matmuls are the slow path on CPUs without half GEMM units, and the
K/V have to be copied out of the pool into head-major order anyway, so the
conversion rides along with that copy (PagedKVCache.read_heads).

`attend` also returns the log-sum-exp, so that two partial attentions over
disjoint KV (a shared prefix and a request's own tail, as cascade decoding
splits them) merge exactly (`merge`).
"""

from __future__ import annotations

import torch


def group_queries(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q: [B, heads, head_dim] -> [B, kv_heads, group, head_dim] float32 (query heads by their KV head)."""
    B, H, D = q.shape
    return q.float().view(B, kv_heads, H // kv_heads, D)


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None,
    scale: float,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of q over one block of KV.

    q: [B, kv_heads, group, head_dim] float32; k, v: [B, kv_heads, T, head_dim] float32;
    bias: [B, 1, 1, T] float32, 0 at real positions and -inf at padding, or None (all real).
    (Leading dims only need to broadcast, and bias to [..., group, T]: the explicit prefill
    path passes q [kv_heads, group, q_len, D], k, v [kv_heads, 1, T, D], bias [q_len, T].)
    Scores are scale * q . k, then softcap * tanh(score / softcap) when softcap is set, then
    the bias. Every row needs at least one real position. Padding K/V must be finite (the
    pool's zeroed pad slot): a masked position still multiplies its V by 0.
    -> out [B, kv_heads, group, head_dim] float32, lse [B, kv_heads, group] float32
    """
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)  # [B, kv_heads, group, T]
    if softcap is not None:
        s.div_(softcap).tanh_().mul_(softcap)
    if bias is not None:
        s.add_(bias)
    lse = torch.logsumexp(s, -1)
    p = s.sub_(lse[..., None]).exp_()  # the softmax, in place
    return torch.matmul(p, v), lse


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Attention over the union of two disjoint KV blocks from the two partial results
    (o: [..., head_dim], lse: [...]): each weighted by its share of the total softmax mass."""
    lse = torch.logaddexp(lse1, lse2)
    return o1 * torch.exp(lse1 - lse)[..., None] + o2 * torch.exp(lse2 - lse)[..., None]

"""Attention mass: how much softmax probability each cached token (and page) received.

Heavy-hitter (H2O-style) KV retention drops the pages of a request that its queries
attend to least, so a backend that reports mass (AttentionBackend.take_page_mass) needs,
per layer, the probabilities of the step's queries over the request's KV. The fast
attention paths (sdpa, the compiled attention kernel, FlashInfer) return only the output and
at most a log-sum-exp, never the probabilities, so this is an extra pass: the scores are
recomputed in float32 from the same K the attention read (the dequantized K of a quantized
pool), under the same scale, soft cap and causal / sliding-window mask (LayerAttention),
and softmaxed. It is the plain reference; it costs one more QK^T per mass request and
layer, so only the requests the scheduler asks for (meta.mass_reqs) pay it.
"""

from __future__ import annotations

import math

import torch

from radixrt.kernels.backend import LayerAttention

# token_mass holds at most this many float32 scores at once.
MASS_SCORES_PER_BLOCK = 1 << 24


def visible(q_pos: torch.Tensor, kv_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """q_pos: [n], kv_pos: [T] int64 positions -> [n, T] bool: which keys each query sees.

    Causal (kv_pos <= q_pos) and, with a window, kv_pos > q_pos - window (HF's sliding window)."""
    mask = kv_pos[None, :] <= q_pos[:, None]
    if window is not None:
        mask &= kv_pos[None, :] > q_pos[:, None] - window
    return mask


def token_mass(q: torch.Tensor, k: torch.Tensor, q_pos: torch.Tensor, kv_pos: torch.Tensor, la: LayerAttention) -> torch.Tensor:
    """Softmax probability each key received, summed over query rows and query heads.

    q: [n, heads, D]; k: [T, kv_heads, D] (query head h reads KV head h // (heads // kv_heads));
    q_pos: [n], kv_pos: [T] int64 positions. Every query must see at least one key (itself).
    -> [T] float32. Query rows go in blocks of at most MASS_SCORES_PER_BLOCK scores.
    """
    n, H, D = q.shape
    T, kv_heads = k.shape[0], k.shape[1]
    qh = q.float().transpose(0, 1).reshape(kv_heads, H // kv_heads, n, D)  # [kv_heads, group, n, D]
    kt = k.float().permute(1, 2, 0)[:, None]  # [kv_heads, 1, D, T]
    mass = torch.zeros(T, dtype=torch.float32, device=q.device)
    block = max(1, MASS_SCORES_PER_BLOCK // (H * T))
    for b0 in range(0, n, block):
        rows = slice(b0, b0 + block)
        s = torch.matmul(qh[:, :, rows], kt).mul_(la.scale)  # [kv_heads, group, b, T]
        if la.softcap is not None:
            s.div_(la.softcap).tanh_().mul_(la.softcap)
        s.masked_fill_(~visible(q_pos[rows], kv_pos, la.window), float("-inf"))
        mass += s.softmax(-1).sum((0, 1, 2))
    return mass


def page_mass(mass: torch.Tensor, page_size: int) -> torch.Tensor:
    """mass: [T] float32 of positions 0 .. T-1 -> [ceil(T / page_size)] float32, summed per page."""
    pages = torch.arange(len(mass), device=mass.device) // page_size
    return torch.zeros(math.ceil(len(mass) / page_size), dtype=torch.float32, device=mass.device).index_add_(0, pages, mass)

"""The one naive attention every attention path is held to: float64 on the CPU, no pages, no tiles."""

from __future__ import annotations

import torch


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [n, H, D], the queries of the last n of the T positions of k, v ([T, Hkv, D]), each reading
    causally up to itself: only the last `window` tokens of that when window is set, and each score
    s capped to softcap * tanh(s / softcap) when softcap is set -> [n, H, D] float64 on the CPU.
    A q of [H, D] is one decode query at the last position -> [H, D]."""
    if q.dim() == 2:
        return naive_attention(q[None], k, v, scale, window, softcap)[0]
    q, k, v = (x.detach().double().cpu() for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("nhd,thd->hnt", q, k) * scale  # [H, n, T]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    n, T = q.shape[0], k.shape[0]
    q_pos = (T - n + torch.arange(n))[:, None]
    kv_pos = torch.arange(T)[None, :]
    mask = kv_pos <= q_pos
    if window is not None:
        mask &= kv_pos > q_pos - window
    return torch.einsum("hnt,thd->nhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), v)

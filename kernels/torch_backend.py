"""TorchBackend: the CPU reference attention over the paged KV cache.

Decode requests (one new token each) attend in one batched call over a padded
gather of their KV; each prefill chunk attends on its own (a few long requests
per step, so the Python loop is per request, never per token). Exactness
matters more than speed here: it is the reference the fast kernels are held to.

NOTE: scaled_dot_product_attention(is_causal=True) aligns the causal mask
top-left, which is only right when a request has no cached prefix. With a
prefix (radix hit, or a later prefill chunk) the mask must be aligned
bottom-right: new token i sees KV positions <= prefix_len + i. We build that
mask explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixrt.kernels.backend import AttentionBackend, AttentionMetadata


@dataclass
class _DecodePlan:
    rows: torch.Tensor  # [Bd] int64 token rows of the decode requests
    slots: torch.Tensor  # [Bd, max_kv] int64 cache slots (padding points at slot 0)
    mask: torch.Tensor  # [Bd, 1, 1, max_kv] bool, True where the slot is real


@dataclass
class _PrefillPlan:
    start: int  # first token row of this request
    end: int
    slots: torch.Tensor  # [kv_len] int64
    mask: torch.Tensor | None  # [q_len, kv_len] bool; None: plain causal (no prefix)


def request_slots(page_table_row: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slots of the given positions (any shape) in one request's pages."""
    return page_table_row[positions // page_size] * page_size + positions % page_size


class TorchBackend(AttentionBackend):
    def init_forward(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        device = meta.out_slots.device
        starts = [0]
        for n in meta.qo_lens:
            starts.append(starts[-1] + n)
        decode = [i for i, n in enumerate(meta.qo_lens) if n == 1]
        self.decode = self._plan_decode(meta, decode, starts, device) if decode else None
        self.prefills = [self._plan_prefill(meta, i, starts, device) for i, n in enumerate(meta.qo_lens) if n > 1]

    def _plan_decode(self, meta: AttentionMetadata, reqs: list[int], starts: list[int], device) -> _DecodePlan:
        idx = torch.tensor(reqs, dtype=torch.int64, device=device)
        kv_lens = torch.tensor([meta.kv_lens[i] for i in reqs], dtype=torch.int64, device=device)
        j = torch.arange(int(kv_lens.max()), device=device)  # [max_kv]
        valid = j[None, :] < kv_lens[:, None]  # [Bd, max_kv]
        pages = meta.page_table[idx][:, j // meta.page_size]  # [Bd, max_kv]
        slots = torch.where(valid, pages * meta.page_size + j % meta.page_size, 0)
        rows = torch.tensor([starts[i] for i in reqs], dtype=torch.int64, device=device)
        return _DecodePlan(rows, slots, valid[:, None, None, :])

    def _plan_prefill(self, meta: AttentionMetadata, i: int, starts: list[int], device) -> _PrefillPlan:
        q_len, kv_len = meta.qo_lens[i], meta.kv_lens[i]
        kv_pos = torch.arange(kv_len, device=device)
        slots = request_slots(meta.page_table[i], kv_pos, meta.page_size)
        prefix = kv_len - q_len
        mask = None
        if prefix > 0:
            q_pos = prefix + torch.arange(q_len, device=device)
            mask = kv_pos[None, :] <= q_pos[:, None]  # bottom-right causal
        return _PrefillPlan(starts[i], starts[i] + q_len, slots, mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.cache.write(layer, self.meta.out_slots, k, v)
        out = torch.empty_like(q)  # [T, heads, head_dim]
        if self.decode is not None:
            d = self.decode
            kd, vd = self.cache.read(layer, d.slots)  # [Bd, max_kv, kv_heads, head_dim]
            qd = q[d.rows].unsqueeze(2)  # [Bd, heads, 1, head_dim]
            od = self._sdpa(qd, kd.transpose(1, 2), vd.transpose(1, 2), d.mask)
            out[d.rows] = od.squeeze(2)
        for p in self.prefills:
            kp, vp = self.cache.read(layer, p.slots)  # [kv_len, kv_heads, head_dim]
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
            op = self._sdpa(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0), p.mask)
            out[p.start : p.end] = op[0].transpose(0, 1)
        return out

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        k, v = k.to(q.dtype), v.to(q.dtype)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)

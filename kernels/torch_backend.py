"""TorchBackend: the CPU reference attention over the paged KV cache.

Decode requests (one new token each) attend in batched calls over a padded
gather of their KV, grouped by length so that short sequences are not padded
to the longest (the gather is most of the cost on CPU). Each prefill chunk
attends on its own (a few long requests per step, so the Python loop is per
request, never per token); a chunk with no cached prefix attends over its own
K/V without reading them back. Exactness matters more than speed here: it is
the reference the fast kernels are held to.

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
    slots: torch.Tensor | None  # [kv_len] int64; None: no cached prefix, attend over the new K/V
    mask: torch.Tensor | None  # [q_len, kv_len] bool; None: plain causal (no prefix)


# A decode group is cut when the next sequence is this much longer than the group's
# shortest: bounds padding waste in the gather to about a third.
DECODE_GROUP_RATIO = 1.5


def decode_groups(kv_lens: list[int], reqs: list[int]) -> list[list[int]]:
    """Split decode requests into groups of similar KV length (each group one batched call)."""
    ordered = sorted(reqs, key=lambda i: kv_lens[i])
    groups: list[list[int]] = []
    for i in ordered:
        if groups and kv_lens[i] <= DECODE_GROUP_RATIO * kv_lens[groups[-1][0]]:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


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
        self.decodes = [self._plan_decode(meta, g, starts, device) for g in decode_groups(meta.kv_lens, decode)]
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
        prefix = kv_len - q_len
        if prefix == 0:
            return _PrefillPlan(starts[i], starts[i] + q_len, None, None)
        kv_pos = torch.arange(kv_len, device=device)
        slots = request_slots(meta.page_table[i], kv_pos, meta.page_size)
        q_pos = prefix + torch.arange(q_len, device=device)
        mask = kv_pos[None, :] <= q_pos[:, None]  # bottom-right causal
        return _PrefillPlan(starts[i], starts[i] + q_len, slots, mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.cache.write(layer, self.meta.out_slots, k, v)
        out = torch.empty_like(q)  # [T, heads, head_dim]
        for d in self.decodes:
            kd, vd = self.cache.read(layer, d.slots)  # [Bd, max_kv, kv_heads, head_dim]
            qd = q[d.rows].unsqueeze(2)  # [Bd, heads, 1, head_dim]
            od = self._sdpa(qd, kd.transpose(1, 2), vd.transpose(1, 2), d.mask)
            out[d.rows] = od.squeeze(2)
        for p in self.prefills:
            # kp, vp: [kv_len, kv_heads, head_dim]
            kp, vp = (k[p.start : p.end], v[p.start : p.end]) if p.slots is None else self.cache.read(layer, p.slots)
            qp = q[p.start : p.end].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, head_dim]
            op = self._sdpa(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0), p.mask)
            out[p.start : p.end] = op[0].transpose(0, 1)
        return out

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        k, v = k.to(q.dtype), v.to(q.dtype)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)

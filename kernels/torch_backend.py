"""TorchBackend: the CPU reference attention over the paged KV cache.

Decode requests (one new token each) attend in batched calls over a padded
gather of their KV, grouped by length so that short sequences are not padded
to the longest (the gather is most of the cost on CPU). Decode requests whose
page tables begin with the same pages (a prefix shared through the radix
cache) attend in cascade: the shared prefix is read once for all of them, each
tail on its own, and the two partial softmaxes are merged exactly by their
log-sum-exps (cascade attention, as FlashInfer's multi-level wrapper does). Each prefill chunk
attends on its own (a few long requests per step, so the Python loop is per
request, never per token); a chunk with no cached prefix attends over its own
K/V without reading them back, unless the pool is quantized: then it reads
them back like every other path, so that prefill and decode see the same
quantized-then-dequantized K/V (as FlashInfer, which always reads the pool).
Exactness matters more than speed here: it is the reference the fast kernels
are held to.

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
    slots: torch.Tensor  # [Bd, max_kv] int64 cache slots (padding points at the cache's zeroed pad_slot)
    mask: torch.Tensor  # [Bd, 1, 1, max_kv] bool, True where the slot is real


@dataclass
class _PrefillPlan:
    start: int  # first token row of this request
    end: int
    slots: torch.Tensor | None  # [kv_len] int64; None: no cached prefix, attend over the new K/V
    mask: torch.Tensor | None  # [q_len, kv_len] bool; None: plain causal (no prefix)


# Shared prefixes shorter than this are left to the plain path (not worth a second pass).
CASCADE_MIN_TOKENS = 64


@dataclass
class _CascadePlan:
    rows: torch.Tensor  # [G] int64 token rows of the requests sharing the prefix
    prefix_slots: torch.Tensor  # [Lp] int64 cache slots of the shared prefix
    tail_slots: torch.Tensor  # [G, max_tail] int64 slots of each request's own tail (padding: pad_slot)
    tail_mask: torch.Tensor  # [G, 1, 1, max_tail] bool


def shared_prefix_groups(page_table: torch.Tensor, reqs: list[int], kv_lens: list[int], page_size: int):
    """Groups of decode requests whose page tables start with the same pages: (members, shared pages)."""
    by_first: dict[int, list[int]] = {}
    for i in reqs:
        by_first.setdefault(int(page_table[i, 0]), []).append(i)
    out = []
    for members in by_first.values():
        if len(members) < 2:
            continue
        # pages every member has before its last (private, being written) page
        limit = min((kv_lens[i] - 1) // page_size for i in members)
        rows = page_table[members, :limit]  # [G, limit]
        shared = int((rows == rows[:1]).all(0).int().cumprod(0).sum()) if limit else 0
        if shared * page_size >= CASCADE_MIN_TOKENS:
            out.append((members, shared))
    return out


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
        self.cascades = []
        for members, shared in shared_prefix_groups(meta.page_table, decode, meta.kv_lens, meta.page_size):
            self.cascades.append(self._plan_cascade(meta, members, shared, starts, device))
            decode = [i for i in decode if i not in members]
        self.decodes = [self._plan_decode(meta, g, starts, device) for g in decode_groups(meta.kv_lens, decode)]
        self.prefills = [self._plan_prefill(meta, i, starts, device) for i, n in enumerate(meta.qo_lens) if n > 1]

    def _plan_decode(self, meta: AttentionMetadata, reqs: list[int], starts: list[int], device) -> _DecodePlan:
        idx = torch.tensor(reqs, dtype=torch.int64, device=device)
        kv_lens = torch.tensor([meta.kv_lens[i] for i in reqs], dtype=torch.int64, device=device)
        j = torch.arange(int(kv_lens.max()), device=device)  # [max_kv]
        valid = j[None, :] < kv_lens[:, None]  # [Bd, max_kv]
        pages = meta.page_table[idx][:, j // meta.page_size]  # [Bd, max_kv]
        slots = torch.where(valid, pages * meta.page_size + j % meta.page_size, self.cache.pad_slot)
        rows = torch.tensor([starts[i] for i in reqs], dtype=torch.int64, device=device)
        return _DecodePlan(rows, slots, valid[:, None, None, :])

    def _plan_cascade(self, meta: AttentionMetadata, members: list[int], shared: int, starts: list[int], device) -> _CascadePlan:
        ps = meta.page_size
        prefix_len = shared * ps
        prefix_slots = request_slots(meta.page_table[members[0]], torch.arange(prefix_len, device=device), ps)
        idx = torch.tensor(members, dtype=torch.int64, device=device)
        tails = torch.tensor([meta.kv_lens[i] - prefix_len for i in members], dtype=torch.int64, device=device)
        j = torch.arange(int(tails.max()), device=device)  # [max_tail]
        valid = j[None, :] < tails[:, None]  # [G, max_tail]
        pos = prefix_len + j
        slots = meta.page_table[idx][:, pos // ps] * ps + pos % ps
        rows = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)
        return _CascadePlan(rows, prefix_slots, torch.where(valid, slots, self.cache.pad_slot), valid[:, None, None, :])

    def _plan_prefill(self, meta: AttentionMetadata, i: int, starts: list[int], device) -> _PrefillPlan:
        q_len, kv_len = meta.qo_lens[i], meta.kv_lens[i]
        prefix = kv_len - q_len
        if prefix == 0 and not self.cache.quantized:
            return _PrefillPlan(starts[i], starts[i] + q_len, None, None)
        kv_pos = torch.arange(kv_len, device=device)
        slots = request_slots(meta.page_table[i], kv_pos, meta.page_size)
        if prefix == 0:  # quantized pool: read the chunk's own K/V back, plain causal mask
            return _PrefillPlan(starts[i], starts[i] + q_len, slots, None)
        q_pos = prefix + torch.arange(q_len, device=device)
        mask = kv_pos[None, :] <= q_pos[:, None]  # bottom-right causal
        return _PrefillPlan(starts[i], starts[i] + q_len, slots, mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.cache.write(layer, self.meta.out_slots, k, v)
        out = torch.empty_like(q)  # [T, heads, head_dim]
        for c in self.cascades:
            out[c.rows] = self._cascade(q[c.rows], c, layer)
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

    def _cascade(self, q: torch.Tensor, c: _CascadePlan, layer: int) -> torch.Tensor:
        """q: [G, heads, head_dim] -> [G, heads, head_dim], attending over shared prefix + own tail."""
        G, H, D = q.shape
        kp, vp = self.cache.read(layer, c.prefix_slots)  # [Lp, kv_heads, head_dim]
        kv_heads = kp.shape[1]
        qg = q.float().view(G, kv_heads, H // kv_heads, D)  # query heads grouped by their KV head
        # The prefix, once for every member: [kv_heads, G * group, Lp]
        qp = qg.permute(1, 0, 2, 3).reshape(kv_heads, -1, D)
        sp = torch.matmul(qp, kp.float().permute(1, 2, 0)) * self.scale
        lse_p = torch.logsumexp(sp, -1)  # [kv_heads, G * group]
        op = torch.matmul(torch.softmax(sp, -1), vp.float().transpose(0, 1))  # [kv_heads, G * group, D]
        op = op.view(kv_heads, G, -1, D).permute(1, 0, 2, 3)  # [G, kv_heads, group, D]
        lse_p = lse_p.view(kv_heads, G, -1).permute(1, 0, 2)  # [G, kv_heads, group]
        # Each member's own tail: [G, kv_heads, group, max_tail]
        kt, vt = self.cache.read(layer, c.tail_slots)  # [G, max_tail, kv_heads, head_dim]
        st = torch.einsum("bhgd,bthd->bhgt", qg, kt.float()) * self.scale
        st = st.masked_fill(~c.tail_mask, float("-inf"))
        lse_t = torch.logsumexp(st, -1)
        ot = torch.einsum("bhgt,bthd->bhgd", torch.softmax(st, -1), vt.float())
        # Merge the two partial softmaxes by their log-sum-exps.
        lse = torch.logaddexp(lse_p, lse_t)
        o = op * torch.exp(lse_p - lse)[..., None] + ot * torch.exp(lse_t - lse)[..., None]
        return o.reshape(G, H, D).to(q.dtype)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        k, v = k.to(q.dtype), v.to(q.dtype)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)

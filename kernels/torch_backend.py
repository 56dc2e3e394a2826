"""TorchBackend: the CPU reference attention over the paged KV cache.

Decode requests (one new token each) attend through the compiled kernel
(native_decode.py), which reads each request's pages in place, all requests in
one call; where it cannot build, through decode_attention.py's grouped float32
matmuls over a padded gather, grouped by length so that short sequences are not
padded to the longest. bench/attention_cpu.py measures both against
scaled_dot_product_attention with one query row: the kernel is 2.2-14x faster
in every case; the torch path 2.6-6x in bf16 and 0.6-1.0x in fp32, where one
fallback path still serves (fp32 pools normally take the kernel). Decode requests whose
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

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixrt.kernels.backend import AttentionBackend, AttentionMetadata
from radixrt.kernels.decode_attention import attend, group_queries, merge
from radixrt.kernels.kv_cache import PagedKVCache
from radixrt.kernels.native_decode import KINDS, NativeDecode, load_native_decode


@dataclass
class _KVRun:
    """Requests each attending over its KV from one page column on, `lens` tokens long: as the
    compiled kernel reads it (pages, lens) or as the torch path gathers it (slots, bias)."""

    pages: torch.Tensor  # [B, P] int64 page ids, from the run's first page column
    lens: torch.Tensor  # [B] int64 tokens of each request in the run (>= 1)
    slots: torch.Tensor | None = None  # torch path: [B, max_len] int64 (padding points at the zeroed pad_slot)
    bias: torch.Tensor | None = None  # torch path: [B, 1, 1, max_len] float32, 0 where real, -inf at padding


@dataclass
class _DecodePlan:
    rows: torch.Tensor  # [Bd] int64 token rows of the decode requests
    run: _KVRun  # their whole KV


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
    tail: _KVRun  # each request's own tail, after the shared pages


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


def padding_bias(valid: torch.Tensor) -> torch.Tensor:
    """valid: [B, T] bool -> [B, 1, 1, T] float32 additive mask: 0 where valid, -inf elsewhere."""
    return torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill_(~valid, float("-inf"))[
        :, None, None, :
    ]


def request_slots(page_table_row: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slots of the given positions (any shape) in one request's pages."""
    return page_table_row[positions // page_size] * page_size + positions % page_size


class TorchBackend(AttentionBackend):
    def __init__(self, cache: PagedKVCache, num_heads: int, head_dim: int, scale: float, native: bool | None = None) -> None:
        """native: decode through the compiled kernel (native_decode.py). None: where it builds and
        serves the pool's dtype (float32, bfloat16 on CPU); True: required (raises without it); False: never."""
        super().__init__(cache, num_heads, head_dim, scale)
        self.native: NativeDecode | None = None
        if native is not False:
            serves = cache.storage_dtype in KINDS and cache.k[0].device.type == "cpu"
            self.native = load_native_decode() if serves else None
            if native and self.native is None:
                raise RuntimeError(f"the compiled decode kernel is unavailable for a {cache.storage_dtype} pool here")

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
        # The kernel reads each request's own length; the torch path pads, so it groups by length.
        groups = ([decode] if decode else []) if self.native is not None else decode_groups(meta.kv_lens, decode)
        self.decodes = [self._plan_decode(meta, g, starts, device) for g in groups]
        self.prefills = [self._plan_prefill(meta, i, starts, device) for i, n in enumerate(meta.qo_lens) if n > 1]

    def _plan_run(self, meta: AttentionMetadata, reqs: list[int], first_page: int, lens: list[int]) -> _KVRun:
        """reqs' KV from page column first_page on, lens[i] tokens each."""
        device, ps = meta.page_table.device, meta.page_size
        idx = torch.tensor(reqs, dtype=torch.int64, device=device)
        n = torch.tensor(lens, dtype=torch.int64, device=device)
        pages = meta.page_table[idx, first_page : first_page + math.ceil(max(lens) / ps)].contiguous()  # [B, P]
        if self.native is not None:
            return _KVRun(pages, n)
        j = torch.arange(max(lens), device=device)  # [max_len]
        valid = j[None, :] < n[:, None]  # [B, max_len]
        slots = torch.where(valid, pages[:, j // ps] * ps + j % ps, self.cache.pad_slot)
        return _KVRun(pages, n, slots, padding_bias(valid))

    def _plan_decode(self, meta: AttentionMetadata, reqs: list[int], starts: list[int], device) -> _DecodePlan:
        rows = torch.tensor([starts[i] for i in reqs], dtype=torch.int64, device=device)
        return _DecodePlan(rows, self._plan_run(meta, reqs, 0, [meta.kv_lens[i] for i in reqs]))

    def _plan_cascade(self, meta: AttentionMetadata, members: list[int], shared: int, starts: list[int], device) -> _CascadePlan:
        prefix_len = shared * meta.page_size
        prefix_slots = request_slots(meta.page_table[members[0]], torch.arange(prefix_len, device=device), meta.page_size)
        tail = self._plan_run(meta, members, shared, [meta.kv_lens[i] - prefix_len for i in members])
        rows = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)
        return _CascadePlan(rows, prefix_slots, tail)

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
            out[d.rows] = self._attend_run(q[d.rows], d.run, layer)[0].to(q.dtype)
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
        kp, vp = self.cache.read_heads(layer, c.prefix_slots[None])  # [1, kv_heads, Lp, head_dim] float32
        kv_heads = kp.shape[1]
        qg = group_queries(q, kv_heads)  # [G, kv_heads, group, D]
        # The prefix, once for every member: all G * group query rows of a KV head in one matmul.
        qp = qg.permute(1, 0, 2, 3).reshape(1, kv_heads, -1, D)  # [1, kv_heads, G * group, D]
        op, lse_p = attend(qp, kp, vp, None, self.scale)
        op = op.view(kv_heads, G, -1, D).permute(1, 0, 2, 3)  # [G, kv_heads, group, D]
        lse_p = lse_p.view(kv_heads, G, -1).permute(1, 0, 2)  # [G, kv_heads, group]
        # Each member's own tail, then the two partial softmaxes merged by their log-sum-exps.
        ot, lse_t = self._attend_run(q, c.tail, layer)  # [G, heads, D], [G, heads]
        return merge(op.reshape(G, H, D), lse_p.reshape(G, H), ot, lse_t).to(q.dtype)

    def _attend_run(self, q: torch.Tensor, run: _KVRun, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [B, heads, head_dim] over each request's run -> out [B, heads, head_dim], lse [B, heads], float32."""
        B, H, D = q.shape
        if self.native is not None:
            k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]
            out, lse = self.native(q.float().contiguous(), k_pool, v_pool, run.pages, run.lens, self.scale, want_lse=True)
            return out, lse
        k, v = self.cache.read_heads(layer, run.slots)  # [B, kv_heads, max_len, head_dim] float32
        out, lse = attend(group_queries(q, k.shape[1]), k, v, run.bias, self.scale)
        return out.reshape(B, H, D), lse.reshape(B, H)

    def _sdpa(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        k, v = k.to(q.dtype), v.to(q.dtype)
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=True)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)

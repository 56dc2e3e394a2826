"""TorchBackend: the CPU attention over the paged KV cache, and the reference the fast kernels are held to.

Where the compiled kernel builds (native_attention.py: one C source per ISA, the pool read in
place) every request attends through it in one call per layer: decodes, and prefill chunks
too, each chunk's queries reading causally up to themselves (over the cached prefix, from
the pages). Where it cannot build, or the pool is quantized, the torch path serves: decode
requests through decode_attention.py's grouped float32 matmuls over a padded gather,
grouped by length so that short sequences are not padded to the longest; each prefill
chunk on its own through scaled_dot_product_attention (a few long requests per step, so the
Python loop is per request, never per token). bench/attention_cpu.py measures both. Decode
requests whose page tables begin with the same pages (a prefix shared through the radix
cache) attend in cascade: the shared prefix is read once for all of them (through the
kernel, the members' query rows of a KV head as that head's group; in torch, one grouped
matmul over its gather), each tail on its own, and the two partial softmaxes are merged
exactly by their log-sum-exps (cascade attention, as FlashInfer's multi-level wrapper does).
On the torch path a chunk with no cached prefix attends over its own K/V without reading
them back, unless the pool is quantized: then it reads them back like every other path,
so that prefill and decode see the same quantized-then-dequantized K/V (as FlashInfer,
which always reads the pool). Exactness matters more than speed here: it is the
reference the fast kernels are held to.

Per layer (LayerAttention): its own scale; tanh soft-capping of the scores
(sdpa has none, so a softcapped layer's prefill takes the explicit float32
scores path, `capped_prefill`; its decodes cap inside the kernel or `attend`);
and a sliding window, which only narrows what each query reads (pages keep the
full KV): decodes read the last `window` tokens, prefill chunks get a
bottom-right causal mask cut to the window and skip the prefix no query of the
chunk sees, and a decode whose window does not cover its whole sequence leaves
cascade groups (it could not read the shared prefix whole). The plan depends
on the window only, so `init_forward` plans once per distinct window that cuts
some request of the step (a window no sequence of the step outgrows plans as
no window: Gemma's sliding and full layers share one plan until a sequence
outgrows the window, then take two), and layers share those plans; a layer
without window or cap runs exactly as before.

Attention mass (heavy-hitter retention, take_page_mass): for each request in
meta.mass_reqs, every layer's forward also reads the request's K back from the
pool and recomputes its queries' probabilities (attention_mass.token_mass, an
extra pass: none of the paths above returns them), summed into a per-token
float32 accumulator; take_page_mass folds it into pages. Other requests do no
extra work, and the attention output is untouched either way.

NOTE: scaled_dot_product_attention(is_causal=True) aligns the causal mask
top-left, which is only right when a request has no cached prefix. With a
prefix (radix hit, or a later prefill chunk) the mask must be aligned
bottom-right: new token i sees KV positions <= prefix_len + i. We build that
mask explicitly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from radixrt.kernels.attention_mass import page_mass, token_mass, visible
from radixrt.kernels.backend import AttentionBackend, AttentionMetadata, LayerAttention
from radixrt.kernels.decode_attention import attend, group_queries, merge
from radixrt.kernels.kv_cache import PagedKVCache
from radixrt.kernels.native_attention import KINDS, NativeAttention, load_native_attention


@dataclass
class _KVRun:
    """Requests each attending over its KV from one page column on, `lens` tokens long (of which
    a window reads only the last `window`): as the compiled kernel reads it (pages, lens, window)
    or as the torch path gathers it (slots, bias: just the tokens read)."""

    pages: torch.Tensor  # [B, P] int64 page ids, from the run's first page column
    lens: torch.Tensor  # [B] int64 tokens of each request in the run (>= 1)
    window: int | None = None  # read only each request's last `window` tokens; None: all
    slots: torch.Tensor | None = None  # torch path: [B, max_read] int64 (padding points at the zeroed pad_slot)
    bias: torch.Tensor | None = None  # torch path: [B, 1, 1, max_read] float32, 0 where real, -inf at padding


@dataclass
class _DecodePlan:
    """Requests attending over their whole KV (or its window): decodes, and with the compiled
    kernel prefill chunks too, each of whose queries reads causally up to itself."""

    rows: torch.Tensor | None  # [n] int64 token rows of the requests' queries, request by request; None: all, in order
    run: _KVRun  # their whole KV (or its window)
    q_starts: torch.Tensor | None = None  # [B + 1] int64 where each request's queries start in rows; None: one each


@dataclass
class _PrefillPlan:
    start: int  # first token row of this request
    end: int
    slots: torch.Tensor | None  # [kv_read] int64 KV read back, from kv_begin; None: attend over the new K/V
    mask: torch.Tensor | None  # [q_len, kv_read] bool; None: plain causal (no prefix, no window cut)


# Shared prefixes shorter than this are left to the plain path (not worth a second pass).
CASCADE_MIN_TOKENS = 64


@dataclass
class _CascadePlan:
    rows: torch.Tensor  # [G] int64 token rows of the requests sharing the prefix
    prefix_slots: torch.Tensor  # [Lp] int64 cache slots of the shared prefix
    prefix_pages: torch.Tensor  # [shared] int64 its page ids
    tail: _KVRun  # each request's own tail, after the shared pages


@dataclass
class _NativeCascades:
    """Every cascade group of a step through the compiled kernel, in two calls per layer whatever
    the number of groups: one over all the shared prefixes, one over all the members' own tails.
    For the prefix call each group's members go in pseudo-requests of `per` members over the
    group's pages, each holding its members' query rows of a KV head as that head's group (the
    kernel reads a KV block once for all of them); a group's last pseudo-request is padded with
    copies of its last member, whose results are dropped."""

    rows: torch.Tensor  # [M] int64 token rows of every member, group by group
    groups: list[list[int]]  # the token rows of each group's members
    per: int  # members per pseudo-request
    spread: torch.Tensor  # [C * per] int64: the member (index into rows) each pseudo-request place holds
    gather: torch.Tensor  # [M] int64: each member's place among the C * per
    prefix_pages: torch.Tensor  # [C, shared] int64 its group's shared pages (padded with its first)
    prefix_lens: torch.Tensor  # [C] int64 its group's shared tokens
    tail: _KVRun  # [M] each member's own tail, after its group's shared pages


@dataclass
class _MassPlan:
    """A request whose attention mass the step sums over its layers."""

    start: int  # first token row of this request
    end: int
    slots: torch.Tensor  # [kv_len] int64 cache slots of positions 0 .. kv_len - 1 (page-table column order)
    kv_pos: torch.Tensor  # [kv_len] int64 positions 0 .. kv_len - 1
    q_pos: torch.Tensor  # [qo_len] int64 positions of the new tokens
    mass: torch.Tensor  # [kv_len] float32 probability each key received, over the layers run so far


@dataclass
class StepPlan:
    """One step for the layers of one window: every layer planned with it runs these."""

    cascades: list[_CascadePlan]  # the torch path: one plan per group
    decodes: list[_DecodePlan]
    prefills: list[_PrefillPlan]
    native_cascades: _NativeCascades | None = None  # the compiled kernel: every group at once

    def cascade_groups(self) -> list[list[int]]:
        """The token rows of each cascade group's members, whichever path reads them."""
        if self.native_cascades is not None:
            return self.native_cascades.groups
        return [c.rows.tolist() for c in self.cascades]


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


def additive_mask(valid: torch.Tensor) -> torch.Tensor:
    """valid: bool, any shape -> float32 of that shape: 0 where valid, -inf elsewhere."""
    return torch.zeros(valid.shape, dtype=torch.float32, device=valid.device).masked_fill_(~valid, float("-inf"))


def padding_bias(valid: torch.Tensor) -> torch.Tensor:
    """valid: [B, T] bool -> [B, 1, 1, T] float32 additive mask: 0 where valid, -inf elsewhere."""
    return additive_mask(valid)[:, None, None, :]


# The explicit (softcapped) prefill path holds at most this many float32 scores at once.
CAPPED_SCORES_PER_BLOCK = 1 << 24


def capped_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, la: LayerAttention
) -> torch.Tensor:
    """A prefill chunk through explicit float32 scores (what sdpa cannot do: a soft cap).

    q: [n, heads, D]; k, v: [T, kv_heads, D]; mask: [n, T] bool, or None for plain causal
    (then T == n) -> [n, heads, D] in q's dtype. Query rows go in blocks that bound the
    scores to CAPPED_SCORES_PER_BLOCK floats.
    """
    n, H, D = q.shape
    kv_heads, T = k.shape[1], k.shape[0]
    if mask is None:
        mask = torch.ones(n, T, dtype=torch.bool, device=q.device).tril_()
    qh = q.float().transpose(0, 1).reshape(kv_heads, H // kv_heads, n, D)  # [kv_heads, group, n, D]
    kh, vh = (x.float().transpose(0, 1)[:, None] for x in (k, v))  # [kv_heads, 1, T, D]
    out = torch.empty_like(qh)
    block = max(1, CAPPED_SCORES_PER_BLOCK // (H * T))
    for b0 in range(0, n, block):
        rows = slice(b0, b0 + block)
        out[:, :, rows] = attend(qh[:, :, rows], kh, vh, additive_mask(mask[rows]), la.scale, la.softcap)[0]
    return out.reshape(H, n, D).transpose(0, 1).to(q.dtype)


def request_slots(page_table_row: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slots of the given positions (any shape) in one request's pages."""
    return page_table_row[positions // page_size] * page_size + positions % page_size


class TorchBackend(AttentionBackend):
    reports_attention_mass = True

    def __init__(
        self,
        cache: PagedKVCache,
        num_heads: int,
        head_dim: int,
        layers: Sequence[LayerAttention],
        native: bool | None = None,
    ) -> None:
        """native: attend through the compiled kernel (native_attention.py). None: where it builds and
        serves the pool's dtype (float32, bfloat16 on CPU); True: required (raises without it); False: never."""
        super().__init__(cache, num_heads, head_dim, layers)
        self.native: NativeAttention | None = None
        if native is not False:
            serves = cache.storage_dtype in KINDS and cache.k[0].device.type == "cpu"
            self.native = load_native_attention(head_dim) if serves else None
            if native and self.native is None:
                raise RuntimeError(f"the compiled attention kernel is unavailable for a {cache.storage_dtype} pool here")

    def init_forward(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        starts = [0]
        for n in meta.qo_lens:
            starts.append(starts[-1] + n)
        longest = max(meta.kv_lens, default=0)
        plans: dict[int | None, StepPlan] = {}
        self.layer_plans: list[StepPlan] = []  # [num_layers]: the plan each layer runs this step
        for la in self.layers:
            window = None if la.sees_all(longest) else la.window  # a window no sequence outgrows cuts nothing
            if window not in plans:
                plans[window] = self._plan_step(meta, window, starts)
            self.layer_plans.append(plans[window])
        self.mass_plans = [self._plan_mass(meta, i, starts) for i in meta.mass_reqs]

    def _plan_mass(self, meta: AttentionMetadata, i: int, starts: list[int]) -> _MassPlan:
        device, kv_len, qo_len = meta.out_slots.device, meta.kv_lens[i], meta.qo_lens[i]
        kv_pos = torch.arange(kv_len, device=device)
        slots = request_slots(meta.page_table[i], kv_pos, meta.page_size)
        q_pos = torch.arange(kv_len - qo_len, kv_len, device=device)
        mass = torch.zeros(kv_len, dtype=torch.float32, device=device)
        return _MassPlan(starts[i], starts[i] + qo_len, slots, kv_pos, q_pos, mass)

    def take_page_mass(self) -> list[torch.Tensor]:
        return [page_mass(m.mass, self.meta.page_size) for m in self.mass_plans]

    def _plan_step(self, meta: AttentionMetadata, window: int | None, starts: list[int]) -> StepPlan:
        device = meta.out_slots.device
        decode = [i for i, n in enumerate(meta.qo_lens) if n == 1]
        # NOTE: a request whose window does not reach back to its first token cannot read a shared
        # prefix whole, so it never joins a cascade; it decodes alone over its window.
        whole = [i for i in decode if window is None or meta.kv_lens[i] <= window]
        groups = shared_prefix_groups(meta.page_table, whole, meta.kv_lens, meta.page_size)
        in_groups = {i for members, _ in groups for i in members}
        decode = [i for i in decode if i not in in_groups]
        chunks = [i for i, n in enumerate(meta.qo_lens) if n > 1]
        if self.native is not None:  # one call: the kernel reads each request's own length, chunks causally
            rest = decode + chunks
            decodes = [self._plan_decode(meta, rest, starts, window, device)] if rest else []
            return StepPlan([], decodes, [], self._plan_native_cascades(meta, groups, starts) if groups else None)
        cascades = [self._plan_cascade(meta, members, shared, starts, device) for members, shared in groups]
        # The torch path pads, so it groups decodes by what they read; each chunk attends on its own.
        reads = meta.kv_lens if window is None else [min(n, window) for n in meta.kv_lens]
        decodes = [self._plan_decode(meta, g, starts, window, device) for g in decode_groups(reads, decode)]
        prefills = [self._plan_prefill(meta, i, starts, window, device) for i in chunks]
        return StepPlan(cascades, decodes, prefills)

    def _plan_run(
        self, meta: AttentionMetadata, reqs: list[int], first_page: int | list[int], lens: list[int], window: int | None
    ) -> _KVRun:
        """reqs' KV from page column first_page on (one for all, or each its own), lens[i] tokens each,
        of which they read the last `window`."""
        device, ps = meta.page_table.device, meta.page_size
        idx = torch.tensor(reqs, dtype=torch.int64, device=device)
        n = torch.tensor(lens, dtype=torch.int64, device=device)
        width = math.ceil(max(lens) / ps)
        if isinstance(first_page, int):
            pages = meta.page_table[idx, first_page : first_page + width].contiguous()  # [B, P]
        else:  # past a request's own pages the columns are padding, clamped into the table: never read
            cols = torch.tensor(first_page, dtype=torch.int64, device=device)[:, None] + torch.arange(width, device=device)
            pages = meta.page_table[idx[:, None], cols.clamp(max=meta.page_table.shape[1] - 1)]
        if self.native is not None:
            return _KVRun(pages, n, window)
        read = n if window is None else n.clamp(max=window)  # [B] tokens each request reads
        j = torch.arange(max(lens) if window is None else min(max(lens), window), device=device)  # [max_read]
        valid = j[None, :] < read[:, None]  # [B, max_read]
        pos = torch.where(valid, (n - read)[:, None] + j[None, :], 0)  # [B, max_read] token positions in the run
        slots = torch.where(valid, pages.gather(1, pos // ps) * ps + pos % ps, self.cache.pad_slot)
        return _KVRun(pages, n, window, slots, padding_bias(valid))

    def _plan_decode(
        self, meta: AttentionMetadata, reqs: list[int], starts: list[int], window: int | None, device
    ) -> _DecodePlan:
        run = self._plan_run(meta, reqs, 0, [meta.kv_lens[i] for i in reqs], window)
        every = reqs == list(range(meta.num_reqs))
        if all(meta.qo_lens[i] == 1 for i in reqs):
            rows = None if every else torch.tensor([starts[i] for i in reqs], dtype=torch.int64, device=device)
            return _DecodePlan(rows, run)
        rows = None if every else torch.cat([torch.arange(starts[i], starts[i] + meta.qo_lens[i], device=device) for i in reqs])
        q_starts = torch.tensor([0] + [meta.qo_lens[i] for i in reqs], dtype=torch.int64, device=device).cumsum(0)
        return _DecodePlan(rows, run, q_starts)

    def _plan_cascade(self, meta: AttentionMetadata, members: list[int], shared: int, starts: list[int], device) -> _CascadePlan:
        """Members read all of their KV (no window cuts it), the shared pages once for all."""
        prefix_len = shared * meta.page_size
        prefix_slots = request_slots(meta.page_table[members[0]], torch.arange(prefix_len, device=device), meta.page_size)
        tail = self._plan_run(meta, members, shared, [meta.kv_lens[i] - prefix_len for i in members], None)
        rows = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)
        return _CascadePlan(rows, prefix_slots, meta.page_table[members[0], :shared].contiguous(), tail)

    def _plan_native_cascades(
        self, meta: AttentionMetadata, groups: list[tuple[list[int], int]], starts: list[int]
    ) -> _NativeCascades:
        """Every group in one plan (_NativeCascades). `per` keeps every thread busy when there are
        few groups and pads no group: at most a share of all members, at most the smallest group."""
        device, ps = meta.page_table.device, meta.page_size
        members = [i for g, _ in groups for i in g]
        per = max(1, min(-(-len(members) // (2 * torch.get_num_threads())), min(len(g) for g, _ in groups)))
        spread, gather, pages, lens = [], [], [], []
        widest = max(shared for _, shared in groups)
        at = 0  # index of the group's first member in `members`
        for g, shared in groups:
            for c0 in range(0, len(g), per):
                place = [at + min(c0 + j, len(g) - 1) for j in range(per)]  # the last member repeats
                gather += [len(spread) + j for j in range(min(per, len(g) - c0))]
                spread += place
                row = meta.page_table[g[0], :shared]
                pages.append(torch.cat([row, row[:1].expand(widest - shared)]))
                lens.append(shared * ps)
            at += len(g)
        def t(x: list[int]) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        tail = self._plan_run(meta, members, [shared for g, shared in groups for _ in g],
                              [meta.kv_lens[i] - shared * ps for g, shared in groups for i in g], None)
        groups_rows = [[starts[i] for i in g] for g, _ in groups]
        return _NativeCascades(t([r for g in groups_rows for r in g]), groups_rows, per, t(spread), t(gather), torch.stack(pages),
                               t(lens), tail)

    def _plan_prefill(self, meta: AttentionMetadata, i: int, starts: list[int], window: int | None, device) -> _PrefillPlan:
        q_len, kv_len = meta.qo_lens[i], meta.kv_lens[i]
        prefix = kv_len - q_len
        rows = (starts[i], starts[i] + q_len)
        cut = window is not None and kv_len > window  # some query of the chunk sees less than all before it
        if prefix == 0 and not cut and not self.cache.quantized:
            return _PrefillPlan(*rows, None, None)
        # KV before kv_begin is outside every query's window (the first query's reaches back the least)
        kv_begin = max(0, prefix - window + 1) if cut else 0
        kv_pos = torch.arange(kv_begin, kv_len, device=device)  # [kv_read]
        # a chunk with no prefix attends over its own new K/V, unless a quantized pool must be read back
        slots = request_slots(meta.page_table[i], kv_pos, meta.page_size) if prefix or self.cache.quantized else None
        if prefix == 0 and not cut:  # quantized pool: read the chunk's own K/V back, plain causal mask
            return _PrefillPlan(*rows, slots, None)
        q_pos = prefix + torch.arange(q_len, device=device)  # [q_len]
        mask = visible(q_pos, kv_pos, window if cut else None)  # bottom-right causal, cut to the window
        return _PrefillPlan(*rows, slots, mask)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.cache.write(layer, self.meta.out_slots, k, v)
        la, plan = self.layers[layer], self.layer_plans[layer]
        out = torch.empty_like(q)  # [T, heads, head_dim]
        if (nc := plan.native_cascades) is not None:
            out[nc.rows] = self._native_cascades(q[nc.rows], nc, layer, la)
        for c in plan.cascades:
            out[c.rows] = self._cascade(q[c.rows], c, layer, la)
        for d in plan.decodes:
            if d.rows is None:  # every row, in order: no gather, no scatter
                out = self._attend_run(q, d.run, layer, la, d.q_starts)[0].to(q.dtype)
            else:
                out[d.rows] = self._attend_run(q[d.rows], d.run, layer, la, d.q_starts)[0].to(q.dtype)
        for p in plan.prefills:
            # kp, vp: [kv_read, kv_heads, head_dim]
            kp, vp = (k[p.start : p.end], v[p.start : p.end]) if p.slots is None else self.cache.read(layer, p.slots)
            out[p.start : p.end] = self._prefill(q[p.start : p.end], kp, vp, p.mask, la)
        for m in self.mass_plans:  # the extra pass: K as the pool holds it (dequantized), positions 0 .. kv_len - 1
            km = self.cache.read_keys(layer, m.slots)  # [kv_len, kv_heads, head_dim]
            m.mass += token_mass(q[m.start : m.end], km, m.q_pos, m.kv_pos, la)
        return out

    def _cascade(self, q: torch.Tensor, c: _CascadePlan, layer: int, la: LayerAttention) -> torch.Tensor:
        """q: [G, heads, head_dim] -> [G, heads, head_dim], attending over shared prefix + own tail."""
        op, lse_p = self._prefix_torch(q, c, layer, la)
        # Each member's own tail, then the two partial softmaxes merged by their log-sum-exps.
        ot, lse_t = self._attend_run(q, c.tail, layer, la)  # [G, heads, D], [G, heads]
        return merge(op, lse_p, ot, lse_t).to(q.dtype)

    def _prefix_torch(self, q: torch.Tensor, c: _CascadePlan, layer: int, la: LayerAttention) -> tuple[torch.Tensor, torch.Tensor]:
        """The shared prefix, once for every member: all G * group query rows of a KV head in one matmul
        over its gathered K/V. q: [G, heads, D] -> out [G, heads, D], lse [G, heads], float32."""
        G, H, D = q.shape
        kp, vp = self.cache.read_heads(layer, c.prefix_slots[None])  # [1, kv_heads, Lp, head_dim] float32
        kv_heads = kp.shape[1]
        qp = group_queries(q, kv_heads).permute(1, 0, 2, 3).reshape(1, kv_heads, -1, D)  # [1, kv_heads, G * group, D]
        op, lse_p = attend(qp, kp, vp, None, la.scale, la.softcap)
        op = op.view(kv_heads, G, -1, D).permute(1, 0, 2, 3)  # [G, kv_heads, group, D]
        lse_p = lse_p.view(kv_heads, G, -1).permute(1, 0, 2)  # [G, kv_heads, group]
        return op.reshape(G, H, D), lse_p.reshape(G, H)

    def _native_cascades(self, q: torch.Tensor, nc: _NativeCascades, layer: int, la: LayerAttention) -> torch.Tensor:
        """q: [M, heads, D] every member's query -> [M, heads, D]: the shared prefixes in one call (the
        pseudo-requests of _NativeCascades), the tails in another, merged by their log-sum-exps."""
        H, D = q.shape[1:]
        kv_heads, C = self.cache.k[layer].shape[2], nc.prefix_lens.shape[0]
        qg = group_queries(q, kv_heads)[nc.spread]  # [C * per, kv_heads, group, D] float32
        # [C, kv_heads * per * group, D]: a pseudo-request's rows of one KV head are that head's group
        qc = qg.view(C, nc.per, kv_heads, -1, D).transpose(1, 2).reshape(C, -1, D).contiguous()
        op, lse_p = self.native(qc, self.cache.k[layer], self.cache.v[layer], nc.prefix_pages, nc.prefix_lens, la.scale,
                                want_lse=True, softcap=la.softcap)
        op = op.view(C, kv_heads, nc.per, -1, D).transpose(1, 2).reshape(C * nc.per, H, D)[nc.gather]
        lse_p = lse_p.view(C, kv_heads, nc.per, -1).transpose(1, 2).reshape(C * nc.per, H)[nc.gather]
        ot, lse_t = self._attend_run(q, nc.tail, layer, la)  # [M, heads, D], [M, heads]
        return merge(op, lse_p, ot, lse_t).to(q.dtype)

    def _attend_run(
        self, q: torch.Tensor, run: _KVRun, layer: int, la: LayerAttention, q_starts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [n, heads, head_dim] over each request's run -> out [n, heads, head_dim], lse [n, heads], float32.
        One query per request (n == B), or with q_starts (compiled kernel only) each request's chunk."""
        B, H, D = q.shape
        if self.native is not None:
            k_pool, v_pool = self.cache.k[layer], self.cache.v[layer]
            return self.native(q.float().contiguous(), k_pool, v_pool, run.pages, run.lens, la.scale, want_lse=True,
                               window=run.window, softcap=la.softcap, q_starts=q_starts)
        k, v = self.cache.read_heads(layer, run.slots)  # [B, kv_heads, max_read, head_dim] float32
        out, lse = attend(group_queries(q, k.shape[1]), k, v, run.bias, la.scale, la.softcap)
        return out.reshape(B, H, D), lse.reshape(B, H)

    def _prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, la: LayerAttention
    ) -> torch.Tensor:
        """q: [n, heads, D]; k, v: [T, kv_heads, D]; mask [n, T] bool or None (plain causal) -> [n, heads, D]."""
        if la.softcap is not None:
            return capped_prefill(q, k, v, mask, la)
        qs = q.transpose(0, 1).unsqueeze(0)  # [1, heads, n, D]
        ks, vs = (x.to(q.dtype).transpose(0, 1).unsqueeze(0) for x in (k, v))  # [1, kv_heads, T, D]
        if mask is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=la.scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=la.scale, enable_gqa=True)
        return o[0].transpose(0, 1)

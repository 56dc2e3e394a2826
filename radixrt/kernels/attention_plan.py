"""The plan of one TorchBackend step: which requests attend how, worked out once per step from
the metadata, before any layer runs (layers whose windows cut the same requests share a plan).

With the compiled kernel (native_attention.py) every request goes in one call per layer:
decodes, and prefill chunks too, each chunk's queries reading causally up to themselves.
On the torch path decode requests go in groups of similar length (one padded gather and
matmul each, so short sequences are not padded to the longest), and each prefill chunk on
its own, with its explicit bottom-right causal mask when it has a cached prefix or a window
cuts it. Decode requests whose page tables begin with the same pages (a prefix shared
through the radix cache) form cascade groups: the shared prefix read once for all, each
tail on its own; through the kernel every group goes in two calls per layer
(NativeCascades). A decode whose window does not cover its whole sequence never joins one.
A request whose attention mass the step sums (heavy-hitter retention) gets a MassPlan.
A request verifying a draft tree (AttentionMetadata.trees) attends with its tree mask: through
the kernel, where no window cuts it, in the step's TreePlan (its rows read the cached prefix as
one pseudo-request, and their ancestors among the new rows under the mask, merged by log-sum-exp);
otherwise as a prefill chunk whose explicit mask holds the tree.

Tensors here are indices and masks (int64 page ids and cache slots, bool or float32 masks),
on the pool's device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from radixrt.kernels.attention_mass import visible
from radixrt.kernels.backend import AttentionMetadata, LayerAttention
from radixrt.kernels.kv_cache import PagedKVCache


@dataclass
class KVRun:
    """Requests each attending over its KV from one page column on, `lens` tokens long (of which
    a window reads only the last `window`): as the compiled kernel reads it (pages, lens, window)
    or as the torch path gathers it (slots, bias: just the tokens read)."""

    pages: torch.Tensor  # [B, P] int64 page ids, from the run's first page column
    lens: torch.Tensor  # [B] int64 tokens of each request in the run (>= 1)
    window: int | None = None  # read only each request's last `window` tokens; None: all
    slots: torch.Tensor | None = None  # torch path: [B, max_read] int64 (padding points at the zeroed pad_slot)
    bias: torch.Tensor | None = None  # torch path: [B, 1, 1, max_read] float32, 0 where real, -inf at padding


@dataclass
class DecodePlan:
    """Requests attending over their whole KV (or its window): decodes, and with the compiled
    kernel prefill chunks too, each of whose queries reads causally up to itself."""

    rows: torch.Tensor | None  # [n] int64 token rows of the requests' queries, request by request; None: all, in order
    run: KVRun  # their whole KV (or its window)
    q_starts: torch.Tensor | None = None  # [B + 1] int64 where each request's queries start in rows; None: one each


@dataclass
class TreePlan:
    """Every request of a step verifying a draft tree through the compiled kernel (no window cuts
    them), at once: R requests of at most Q new rows, N rows in all, padded to Q. One kernel call
    reads the cached prefixes, a request's rows of a KV head as that head's group (each KV block
    read once for all of them, as NativeCascades does); one batched explicit attention reads the
    new rows under the trees' masks."""

    rows: torch.Tensor  # [N] int64 token rows of their queries, request by request
    prefix: KVRun  # [R] each request's cached prefix
    place: torch.Tensor  # [R, Q] int64 index into rows of each request's j-th row (padding: its first)
    gather: torch.Tensor  # [N] int64 each row's place in the [R * Q] padded rows
    slots: torch.Tensor  # [R, Q] int64 cache slots of the new rows (written before the attention; padding: pad_slot)
    bias: torch.Tensor  # [R, 1, 1, Q, Q] float32: 0 where a row sees a new row (its tree mask), -inf elsewhere


@dataclass
class PrefillPlan:
    start: int  # first token row of this request
    end: int
    slots: torch.Tensor | None  # [kv_read] int64 KV read back, from kv_begin; None: attend over the new K/V
    mask: torch.Tensor | None  # [q_len, kv_read] bool; None: plain causal (no prefix, no window cut)


# Shared prefixes shorter than this are left to the plain path (not worth a second pass).
CASCADE_MIN_TOKENS = 64


@dataclass
class CascadePlan:
    rows: torch.Tensor  # [G] int64 token rows of the requests sharing the prefix
    prefix_slots: torch.Tensor  # [Lp] int64 cache slots of the shared prefix
    prefix_pages: torch.Tensor  # [shared] int64 its page ids
    tail: KVRun  # each request's own tail, after the shared pages


@dataclass
class NativeCascades:
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
    tail: KVRun  # [M] each member's own tail, after its group's shared pages


@dataclass
class MassPlan:
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

    cascades: list[CascadePlan]  # the torch path: one plan per group
    decodes: list[DecodePlan]
    prefills: list[PrefillPlan]
    native_cascades: NativeCascades | None = None  # the compiled kernel: every group at once
    trees: TreePlan | None = None  # the compiled kernel: every draft tree at once

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


def request_slots(page_table_row: torch.Tensor, positions: torch.Tensor, page_size: int) -> torch.Tensor:
    """Cache slots of the given positions (any shape) in one request's pages."""
    return page_table_row[positions // page_size] * page_size + positions % page_size


class StepPlanner:
    """Plans steps for the paths a TorchBackend attends through (native: the compiled kernel)."""

    def __init__(self, cache: PagedKVCache, native: bool) -> None:
        self.cache, self.native = cache, native

    def plan(self, meta: AttentionMetadata, layers: Sequence[LayerAttention]) -> tuple[list[StepPlan], list[MassPlan]]:
        """The plan each layer runs this step ([num_layers], shared by layers of one effective
        window), and the attention-mass plans of meta.mass_reqs."""
        starts = [0]
        for n in meta.qo_lens:
            starts.append(starts[-1] + n)
        longest = max(meta.kv_lens, default=0)
        plans: dict[int | None, StepPlan] = {}
        layer_plans = []
        for la in layers:
            window = None if la.sees_all(longest) else la.window  # a window no sequence outgrows cuts nothing
            if window not in plans:
                plans[window] = self._plan_step(meta, window, starts)
            layer_plans.append(plans[window])
        return layer_plans, [self._plan_mass(meta, i, starts) for i in meta.mass_reqs]

    def _plan_mass(self, meta: AttentionMetadata, i: int, starts: list[int]) -> MassPlan:
        device, kv_len, qo_len = meta.out_slots.device, meta.kv_lens[i], meta.qo_lens[i]
        kv_pos = torch.arange(kv_len, device=device)
        slots = request_slots(meta.page_table[i], kv_pos, meta.page_size)
        q_pos = torch.arange(kv_len - qo_len, kv_len, device=device)
        mass = torch.zeros(kv_len, dtype=torch.float32, device=device)
        return MassPlan(starts[i], starts[i] + qo_len, slots, kv_pos, q_pos, mass)

    def _plan_step(self, meta: AttentionMetadata, window: int | None, starts: list[int]) -> StepPlan:
        device = meta.out_slots.device
        decode = [i for i, n in enumerate(meta.qo_lens) if n == 1]
        # NOTE: a request whose window does not reach back to its first token cannot read a shared
        # prefix whole, so it never joins a cascade; it decodes alone over its window.
        whole = [i for i in decode if window is None or meta.kv_lens[i] <= window]
        groups = shared_prefix_groups(meta.page_table, whole, meta.kv_lens, meta.page_size)
        in_groups = {i for members, _ in groups for i in members}
        decode = [i for i in decode if i not in in_groups]
        chunks = [i for i, n in enumerate(meta.qo_lens) if n > 1 and i not in meta.trees]
        # a tree through the kernel needs a prefix to read (a decode of none is no call) and no window
        native_trees = [i for i in meta.trees if self.native and window is None and meta.kv_lens[i] > meta.qo_lens[i]]
        masked = [self._plan_tree_prefill(meta, i, starts, window, device) for i in meta.trees if i not in native_trees]
        if self.native:  # one call: the kernel reads each request's own length, chunks causally
            rest = decode + chunks
            decodes = [self._plan_decode(meta, rest, starts, window, device)] if rest else []
            return StepPlan([], decodes, masked, self._plan_native_cascades(meta, groups, starts) if groups else None,
                            self._plan_trees(meta, native_trees, starts) if native_trees else None)
        cascades = [self._plan_cascade(meta, members, shared, starts, device) for members, shared in groups]
        # The torch path pads, so it groups decodes by what they read; each chunk attends on its own.
        reads = meta.kv_lens if window is None else [min(n, window) for n in meta.kv_lens]
        decodes = [self._plan_decode(meta, g, starts, window, device) for g in decode_groups(reads, decode)]
        prefills = [self._plan_prefill(meta, i, starts, window, device) for i in chunks]
        return StepPlan(cascades, decodes, prefills + masked)

    def _plan_run(
        self, meta: AttentionMetadata, reqs: list[int], first_page: int | list[int], lens: list[int], window: int | None
    ) -> KVRun:
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
        if self.native:
            return KVRun(pages, n, window)
        read = n if window is None else n.clamp(max=window)  # [B] tokens each request reads
        j = torch.arange(max(lens) if window is None else min(max(lens), window), device=device)  # [max_read]
        valid = j[None, :] < read[:, None]  # [B, max_read]
        pos = torch.where(valid, (n - read)[:, None] + j[None, :], 0)  # [B, max_read] token positions in the run
        slots = torch.where(valid, pages.gather(1, pos // ps) * ps + pos % ps, self.cache.pad_slot)
        return KVRun(pages, n, window, slots, padding_bias(valid))

    def _plan_decode(
        self, meta: AttentionMetadata, reqs: list[int], starts: list[int], window: int | None, device
    ) -> DecodePlan:
        run = self._plan_run(meta, reqs, 0, [meta.kv_lens[i] for i in reqs], window)
        every = reqs == list(range(meta.num_reqs))
        if all(meta.qo_lens[i] == 1 for i in reqs):
            rows = None if every else torch.tensor([starts[i] for i in reqs], dtype=torch.int64, device=device)
            return DecodePlan(rows, run)
        rows = None if every else torch.cat([torch.arange(starts[i], starts[i] + meta.qo_lens[i], device=device) for i in reqs])
        q_starts = torch.tensor([0] + [meta.qo_lens[i] for i in reqs], dtype=torch.int64, device=device).cumsum(0)
        return DecodePlan(rows, run, q_starts)

    def _plan_cascade(self, meta: AttentionMetadata, members: list[int], shared: int, starts: list[int], device) -> CascadePlan:
        """Members read all of their KV (no window cuts it), the shared pages once for all."""
        prefix_len = shared * meta.page_size
        prefix_slots = request_slots(meta.page_table[members[0]], torch.arange(prefix_len, device=device), meta.page_size)
        tail = self._plan_run(meta, members, shared, [meta.kv_lens[i] - prefix_len for i in members], None)
        rows = torch.tensor([starts[i] for i in members], dtype=torch.int64, device=device)
        return CascadePlan(rows, prefix_slots, meta.page_table[members[0], :shared].contiguous(), tail)

    def _plan_native_cascades(
        self, meta: AttentionMetadata, groups: list[tuple[list[int], int]], starts: list[int]
    ) -> NativeCascades:
        """Every group in one plan (NativeCascades). `per` keeps every thread busy when there are
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
        return NativeCascades(t([r for g in groups_rows for r in g]), groups_rows, per, t(spread), t(gather), torch.stack(pages),
                               t(lens), tail)

    def _plan_prefill(self, meta: AttentionMetadata, i: int, starts: list[int], window: int | None, device) -> PrefillPlan:
        q_len, kv_len = meta.qo_lens[i], meta.kv_lens[i]
        prefix = kv_len - q_len
        rows = (starts[i], starts[i] + q_len)
        cut = window is not None and kv_len > window  # some query of the chunk sees less than all before it
        if prefix == 0 and not cut and not self.cache.quantized:
            return PrefillPlan(*rows, None, None)
        # KV before kv_begin is outside every query's window (the first query's reaches back the least)
        kv_begin = max(0, prefix - window + 1) if cut else 0
        kv_pos = torch.arange(kv_begin, kv_len, device=device)  # [kv_read]
        # a chunk with no prefix attends over its own new K/V, unless a quantized pool must be read back
        slots = request_slots(meta.page_table[i], kv_pos, meta.page_size) if prefix or self.cache.quantized else None
        if prefix == 0 and not cut:  # quantized pool: read the chunk's own K/V back, plain causal mask
            return PrefillPlan(*rows, slots, None)
        q_pos = prefix + torch.arange(q_len, device=device)  # [q_len]
        mask = visible(q_pos, kv_pos, window if cut else None)  # bottom-right causal, cut to the window
        return PrefillPlan(*rows, slots, mask)

    def _plan_trees(self, meta: AttentionMetadata, reqs: list[int], starts: list[int]) -> TreePlan:
        device = meta.page_table.device
        q_lens = [meta.qo_lens[i] for i in reqs]
        R, Q = len(reqs), max(q_lens)
        t = lambda x: torch.tensor(x, dtype=torch.int64, device=device)  # noqa: E731
        prefix = self._plan_run(meta, reqs, 0, [meta.kv_lens[i] - meta.qo_lens[i] for i in reqs], None)
        firsts = [sum(q_lens[:r]) for r in range(R)]
        place = t([[firsts[r] + (j if j < q else 0) for j in range(Q)] for r, q in enumerate(q_lens)])
        gather = t([r * Q + j for r, q in enumerate(q_lens) for j in range(q)])
        rows = t([starts[i] + j for i in reqs for j in range(meta.qo_lens[i])])
        slots = torch.full((R * Q,), self.cache.pad_slot, dtype=torch.int64, device=device)
        slots[gather] = meta.out_slots[rows]
        bias = torch.full((R, Q, Q), float("-inf"), dtype=torch.float32, device=device)
        bias[:, :, 0] = 0.0  # a padding row reads its request's root: finite, and dropped
        for r, i in enumerate(reqs):
            bias[r, : q_lens[r], : q_lens[r]] = additive_mask(meta.trees[i])
        return TreePlan(rows, prefix, place, gather, slots.view(R, Q), bias[:, None, None])

    def _plan_tree_prefill(self, meta: AttentionMetadata, i: int, starts: list[int], window: int | None, device) -> PrefillPlan:
        """A draft tree as a prefill chunk with an explicit mask: the cached prefix (cut to each row's
        window), and the new rows its tree mask names."""
        tree, q_len, kv_len = meta.trees[i], meta.qo_lens[i], meta.kv_lens[i]
        prefix = kv_len - q_len
        q_pos = prefix + tree.sum(1) - 1  # [q_len] a draft's position: the root's plus its depth
        kv_begin = max(0, prefix - window + 1) if window is not None else 0  # before the first row's window
        old = torch.arange(kv_begin, prefix, device=device)
        slots = request_slots(meta.page_table[i], torch.arange(kv_begin, kv_len, device=device), meta.page_size)
        mask = torch.cat([visible(q_pos, old, window), tree & visible(q_pos, q_pos, window)], 1)
        return PrefillPlan(starts[i], starts[i] + q_len, slots, mask)

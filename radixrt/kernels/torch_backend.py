"""TorchBackend: the CPU attention over the paged KV cache, and the reference the fast kernels are held to.

Where the compiled kernel builds (native_attention.py: one C source per ISA, the pool read in
place) every request attends through it in one call per layer: decodes, and prefill chunks
too, each chunk's queries reading causally up to themselves (over the cached prefix, from
the pages). Where it cannot build, or the pool is fp8 or of two formats (K:V), the torch path serves: decode
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
without window or cap runs exactly as before. The planning (which request goes
which way, with what indices and masks) is attention_plan.py; this module runs
the plans, layer by layer.

Draft trees (speculative verification, AttentionMetadata.trees): through the kernel, every
tree of the step reads its cached prefix in one call, a request's rows of a KV head as that
head's group (as a cascade's shared prefix is read), and the trees' new rows attend to their
ancestors through one batched float32 attention, padded to the largest tree, under their
masks; the two partial softmaxes merge by their log-sum-exps. Where a window cuts the tree,
or on the torch path, the tree is a prefill chunk whose explicit mask holds it.

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

from typing import Sequence

import torch
import torch.nn.functional as F

from radixrt.kernels.attention_mass import page_mass, token_mass
from radixrt.kernels.attention_plan import (
    CascadePlan,
    KVRun,
    NativeCascades,
    StepPlan,
    StepPlanner,
    TreePlan,
    additive_mask,
)
from radixrt.kernels.backend import AttentionBackend, AttentionMetadata, LayerAttention
from radixrt.kernels.decode_attention import attend, group_queries, merge
from radixrt.kernels.kv_cache import PagedKVCache
from radixrt.kernels.kernel_choice import KernelChoice, Shape, choose_kernels
from radixrt.kernels.kv_quant import rotated
from radixrt.kernels.native_attention import KINDS, LayerStep, NativeAttention


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
        """native: attend through the compiled kernel (native_attention.py), each shape class through
        the variant kernel_choice.py picks. None: where it builds and serves the pool's dtype (float32,
        bfloat16 on CPU); True: required (raises without it); False: never."""
        super().__init__(cache, num_heads, head_dim, layers)
        self.kernels: KernelChoice | None = None
        serves = cache.storage_dtype in KINDS and cache.k[0].device.type == "cpu"
        if native is not False and serves:
            _, page_size, kv_heads, _ = cache.k[0].shape
            self.kernels = choose_kernels(Shape(num_heads, kv_heads, head_dim, page_size, cache.storage_dtype))
        if native and self.kernels is None:
            raise RuntimeError(f"the compiled attention kernel is unavailable for a {cache.storage_dtype} pool here")
        self.planner = StepPlanner(cache, self.kernels is not None)
        self.kernels_reason = self.kernels.reason if self.kernels is not None else "the torch path: " + (
            "not asked for the compiled kernel" if native is False else "no variant of the kernel builds here" if serves
            else f"the compiled kernel does not serve a {cache.storage_dtype} pool on {cache.k[0].device.type}")

    def kernels_info(self) -> tuple[dict[str, str], str]:
        return (self.kernels.names() if self.kernels is not None else {}), self.kernels_reason

    def init_forward(self, meta: AttentionMetadata) -> None:
        self.meta = meta
        # [num_layers]: the plan each layer runs this step; one mass plan per meta.mass_reqs
        self.layer_plans, self.mass_plans = self.planner.plan(meta, self.layers)
        # [num_layers]: the layer entry where the kernel stores and attends alone (else None)
        steps = {id(p): self._layer_step(p, meta) for p in {id(p): p for p in self.layer_plans}.values()}
        self.layer_steps = [steps[id(p)] for p in self.layer_plans]

    def _layer_step(self, plan: StepPlan, meta: AttentionMetadata) -> LayerStep | None:
        """The kernel's layer entry for a plan of one call over every request, in order, into a
        float32 or bf16 pool (quantized pools, cascades, trees, mass and the torch path: None)."""
        if (self.kernels is None or self.cache.quantized or self.mass_plans or plan.cascades or plan.prefills
                or plan.native_cascades is not None or plan.trees is not None or len(plan.decodes) != 1
                or plan.decodes[0].rows is not None):  # fmt: skip
            return None
        d = plan.decodes[0]
        kernel = self.kernels.decode if d.q_starts is None else self.kernels.extend
        return LayerStep(kernel, d.run.pages, d.run.lens, d.q_starts, meta.out_slots, d.run.window)

    def take_page_mass(self) -> list[torch.Tensor]:
        return [page_mass(m.mass, self.meta.page_size) for m in self.mass_plans]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        if (step := self.layer_steps[layer]) is not None:
            la = self.layers[layer]
            out = step(q, k, v, self.cache.k[layer], self.cache.v[layer], la.scale, la.softcap)
            if out is not None:
                return out
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
        if (t := plan.trees) is not None:
            out[t.rows] = self._trees(q[t.rows], t, layer, la)
        for p in plan.prefills:
            # kp, vp: [kv_read, kv_heads, head_dim]
            kp, vp = (k[p.start : p.end], v[p.start : p.end]) if p.slots is None else self.cache.read(layer, p.slots)
            out[p.start : p.end] = self._prefill(q[p.start : p.end], kp, vp, p.mask, la)
        for m in self.mass_plans:  # the extra pass: K as the pool holds it (dequantized), positions 0 .. kv_len - 1
            km = self.cache.read_keys(layer, m.slots)  # [kv_len, kv_heads, head_dim]
            m.mass += token_mass(q[m.start : m.end], km, m.q_pos, m.kv_pos, la)
        return out

    def _cascade(self, q: torch.Tensor, c: CascadePlan, layer: int, la: LayerAttention) -> torch.Tensor:
        """q: [G, heads, head_dim] -> [G, heads, head_dim], attending over shared prefix + own tail."""
        op, lse_p = self._prefix_torch(q, c, layer, la)
        # Each member's own tail, then the two partial softmaxes merged by their log-sum-exps.
        ot, lse_t = self._attend_run(q, c.tail, layer, la)  # [G, heads, D], [G, heads]
        return merge(op, lse_p, ot, lse_t).to(q.dtype)

    def _prefix_torch(self, q: torch.Tensor, c: CascadePlan, layer: int, la: LayerAttention) -> tuple[torch.Tensor, torch.Tensor]:
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

    def _native_cascades(self, q: torch.Tensor, nc: NativeCascades, layer: int, la: LayerAttention) -> torch.Tensor:
        """q: [M, heads, D] every member's query -> [M, heads, D]: the shared prefixes in one call (the
        pseudo-requests of NativeCascades), the tails in another, merged by their log-sum-exps."""
        kv_heads = self.cache.k[layer].shape[2]
        qg = group_queries(q, kv_heads)[nc.spread]  # [C * per, kv_heads, group, D] float32
        op, lse_p = self._grouped_prefixes(qg, nc.per, nc.prefix_pages, nc.prefix_lens, layer, la)
        ot, lse_t = self._attend_run(q, nc.tail, layer, la)  # [M, heads, D], [M, heads]
        return merge(op[nc.gather], lse_p[nc.gather], ot, lse_t).to(q.dtype)

    def _grouped_prefixes(
        self, qg: torch.Tensor, per: int, pages: torch.Tensor, lens: torch.Tensor, layer: int, la: LayerAttention
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """C pseudo-requests of `per` query rows each over their KV (pages, lens: [C, P], [C]) in one
        kernel call, a pseudo-request's rows of a KV head as that head's group (each KV block read
        once for all). qg: [C * per, kv_heads, group, D] float32 -> out [C * per, heads, D], lse
        [C * per, heads], float32."""
        n, kv_heads, group, D = qg.shape
        C = n // per
        qc = qg.view(C, per, kv_heads, group, D).transpose(1, 2).reshape(C, -1, D).contiguous()
        op, lse = self._native(self.kernels.cascade, qc, layer, pages, lens, la)
        op = op.view(C, kv_heads, per, group, D).transpose(1, 2).reshape(n, kv_heads * group, D)
        return op, lse.view(C, kv_heads, per, group).transpose(1, 2).reshape(n, kv_heads * group)

    def _trees(self, q: torch.Tensor, t: TreePlan, layer: int, la: LayerAttention) -> torch.Tensor:
        """q: [N, heads, D] every draft tree's rows -> [N, heads, D]: the cached prefixes through the
        kernel (a request's rows of a KV head as its group), the new rows under the trees' masks
        (one batched attention), padded to [R, Q] rows, merged by their log-sum-exps."""
        H, D = q.shape[1:]
        R, Q = t.slots.shape
        qg = group_queries(q[t.place].view(R * Q, H, D), self.cache.k[layer].shape[2])  # [R * Q, kv_heads, group, D]
        op, lse_p = self._grouped_prefixes(qg, Q, t.prefix.pages, t.prefix.lens, layer, la)
        k, v = self.cache.read_heads(layer, t.slots)  # [R, kv_heads, Q, D] float32
        qh = qg.view(R, Q, *qg.shape[1:]).permute(0, 2, 3, 1, 4)  # [R, kv_heads, group, Q, D]
        ot, lse_t = attend(qh, k[:, :, None], v[:, :, None], t.bias, la.scale, la.softcap)
        ot = ot.permute(0, 3, 1, 2, 4).reshape(R * Q, H, D)  # from [R, kv_heads, group, Q, D]
        lse_t = lse_t.permute(0, 3, 1, 2).reshape(R * Q, H)
        return merge(op, lse_p, ot, lse_t)[t.gather].to(q.dtype)

    def _attend_run(
        self, q: torch.Tensor, run: KVRun, layer: int, la: LayerAttention, q_starts: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [n, heads, head_dim] over each request's run -> out [n, heads, head_dim], lse [n, heads], float32.
        One query per request (n == B), or with q_starts (compiled kernel only) each request's chunk."""
        B, H, D = q.shape
        if self.kernels is not None:  # one row per request: a decode; more: prefill chunks among them
            kernel = self.kernels.decode if q.shape[0] == run.lens.shape[0] else self.kernels.extend
            return self._native(kernel, q, layer, run.pages, run.lens, la, window=run.window, q_starts=q_starts)
        k, v = self.cache.read_heads(layer, run.slots)  # [B, kv_heads, max_read, head_dim] float32
        out, lse = attend(group_queries(q, k.shape[1]), k, v, run.bias, la.scale, la.softcap)
        return out.reshape(B, H, D), lse.reshape(B, H)

    def _native(self, kernel: NativeAttention, q: torch.Tensor, layer: int, pages: torch.Tensor, lens: torch.Tensor,
                la: LayerAttention, **kw) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled kernel over this layer's pool (an int4 or int8 pool with its scales): out and lse, float32.
        Over rotated keys (kv_quant.py) the queries are rotated too, which leaves every score as it was."""
        cache = self.cache
        scales = (cache.k_scales[layer], cache.v_scales[layer]) if cache.k_scales else None
        q = rotated(q) if cache.rotate_k else q.float()
        return kernel(q.contiguous(), cache.k[layer], cache.v[layer], pages, lens, la.scale, want_lse=True,
                      softcap=la.softcap, scales=scales, **kw)

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

"""FlashInferBackend: FlashInfer's paged attention kernels on CUDA, over our pool in place.

Targets flashinfer-python 0.6.13 (the version that fits the GPU machine's
carry; its wrapper signatures were checked with inspect), all arguments
after page_size passed by keyword as 0.7.x requires.

Per step, `init_forward` turns the batch's page tables into FlashInfer's CSR
form (`paged_kv`: int32 kv_indptr / kv_indices / kv_last_page_len; every index
array must be int32) and plans once: the decode wrapper when every request has
one new token, the paged prefill wrapper otherwise (prefill chunks mixed with
decodes). Nothing is read back from the device to do it: indptr and
last_page_len (and the prefill's qo_indptr) are built on the host from the
scheduler's lengths, which is where plan() reads them (given device tensors,
it copies them to the CPU: a sync per step), and kv_indices is gathered on the
device with sizes the host already knows (a boolean-mask select would sync
too); tests/test_host_syncs.py counts the copies. Every layer then writes its
new K/V into the pool first and runs the planned kernel over the pool's own
tensors, layout NHD = [num_pages, page_size, kv_heads, head_dim]. FlashInfer's
`causal=True` is aligned bottom-right, which is exactly a chunk over a cached
prefix.

Per-layer options (LayerAttention) are plan() arguments: `sm_scale`,
`window_left` (= window - 1: FlashInfer counts the keys left of the query's
own, HF counts the query's too) and `logits_soft_cap` (FlashInfer caps
scale * q.k, the Gemma 2 order). FlashInfer compiles a kernel per
window/soft-cap variant and a wrapper holds one plan, so there is one wrapper
(prefill and decode) per distinct LayerAttention, a "kind" (usually one; two
for Gemma's sliding and full layers, as SGLang does), all planned each step
from the same page table (the window narrows what is read, not the pages
listed); a step with draft trees plans the prefill wrappers with a custom mask
(`custom_mask`), all sharing one float workspace (layers run one after another on one
stream); each layer runs its kind's wrapper.

For CUDA graphs (radixrt/worker/cuda_graph.py), `graph_decode_wrappers` makes
one decode wrapper per kind over the graph's fixed buffers and
`init_forward_with` plans them before each replay; the eager path is
`init_forward`, which plans our own wrappers.

TorchBackend is the reference this is held to (tests/test_torch_backend.py
runs the same cases against both on a GPU).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from radixrt.kernels.backend import AttentionBackend, AttentionMetadata, LayerAttention, layer_kinds
from radixrt.kernels.kv_cache import PagedKVCache

WORKSPACE_BYTES = 128 << 20  # FlashInfer's recommended float workspace (split-KV partials)
TENSOR_CORE_GQA_GROUP = 4  # decode through the MMA kernel once the GQA group is this large (as SGLang)
HEAD_DIMS = (64, 128, 256)  # what FlashInfer's decode and prefill kernels are instantiated for
Q_DTYPES = (torch.bfloat16, torch.float16)  # query (model) dtypes it has kernels for: a float32 plan is a KeyError
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
DEVICE_TYPES = ("cuda",)  # where the kernels run (tests/test_host_syncs.py adds "meta" to trace a step's host work)


def uses_tensor_cores(num_heads: int, kv_heads: int) -> bool:
    """Whether decode runs FlashInfer's tensor-core (prefill) kernel rather than its CUDA-core decode kernel."""
    return num_heads // kv_heads >= TENSOR_CORE_GQA_GROUP


@dataclass(frozen=True)
class PagedKV:
    """One step's page table in FlashInfer's CSR form: request b's pages are
    indices[indptr[b]:indptr[b + 1]], the last of them holding last_page_len[b] tokens."""

    indptr: torch.Tensor  # [B + 1] int32, on the host (pinned on CUDA)
    indices: torch.Tensor  # [indptr[-1]] int32, on the page table's device
    last_page_len: torch.Tensor  # [B] int32 in [1, page_size], on the host


def host_int32(values: list[int], device: torch.device) -> torch.Tensor:
    """values as an int32 host tensor, pinned when `device` is CUDA so that copies to it run asynchronously."""
    return torch.tensor(values, dtype=torch.int32, pin_memory=device.type == "cuda")


def paged_kv(meta: AttentionMetadata) -> PagedKV:
    """meta's page table in CSR form, without a device-to-host copy: the lengths come from the
    host lists, and the device gathers each request's first pages with sizes known up front."""
    ps, dev = meta.page_size, meta.page_table.device
    n_pages = [-(-n // ps) for n in meta.kv_lens]  # [B] pages per request
    indptr = host_int32([0, *itertools.accumulate(n_pages)], dev)  # [B + 1]
    last_page_len = host_int32([n - (p - 1) * ps for n, p in zip(meta.kv_lens, n_pages)], dev)  # [B]
    total = sum(n_pages)
    counts = torch.tensor(n_pages, dtype=torch.int64, pin_memory=dev.type == "cuda").to(dev, non_blocking=True)  # [B]
    starts = torch.cumsum(counts, 0) - counts  # [B] first flat index of each request
    # output_size: repeat_interleave would otherwise read the counts' sum back to size its output
    req = torch.repeat_interleave(torch.arange(len(n_pages), device=dev), counts, output_size=total)  # [total]
    col = torch.arange(total, device=dev) - starts[req]  # [total] page-table column of each flat entry
    return PagedKV(indptr, meta.page_table[req, col].to(torch.int32), last_page_len)


def custom_mask(meta: AttentionMetadata) -> torch.Tensor:
    """The step's masks as one flat bool tensor (FlashInfer's custom_mask): per request, row-major
    [qo_len, kv_len], its draft tree's (AttentionMetadata.trees) or bottom-right causal.

    NOTE: FlashInfer applies a layer's window to the row's index, not to a draft's depth, so the
    worker refuses trees on a model with windowed layers (worker/draft_trees.py)."""
    parts = []
    for i, (q_len, kv_len) in enumerate(zip(meta.qo_lens, meta.kv_lens)):
        new = meta.trees.get(i)
        if new is None:
            new = torch.ones(q_len, q_len, dtype=torch.bool, device=meta.page_table.device).tril_()
        old = torch.ones(q_len, kv_len - q_len, dtype=torch.bool, device=new.device)
        parts.append(torch.cat([old, new], 1).flatten())
    return torch.cat(parts)


def plan_options(la: LayerAttention) -> dict[str, Any]:
    """A kind's plan() keywords: its scale, window (FlashInfer's window_left = window - 1; -1: none) and cap (0: none)."""
    return dict(
        sm_scale=la.scale,
        window_left=-1 if la.window is None else la.window - 1,
        logits_soft_cap=0.0 if la.softcap is None else la.softcap,
    )


class FlashInferBackend(AttentionBackend):
    def __init__(self, cache: PagedKVCache, num_heads: int, head_dim: int, layers: Sequence[LayerAttention]) -> None:
        super().__init__(cache, num_heads, head_dim, layers)
        if cache.storage_dtype not in (cache.dtype, torch.float8_e4m3fn, torch.float8_e5m2) or cache.rotate_k:
            raise ValueError(  # FlashInfer's paged kernels read fp8 or the model's dtype, keys as they are
                f"kv_cache_dtype {cache.kv_dtype!r}{' with rotated keys' if cache.rotate_k else ''} is not supported by "
                "attention_backend 'flashinfer'; use attention_backend 'torch', or kv_cache_dtype fp8_e4m3 / fp8_e5m2"
            )
        if cache.dtype not in Q_DTYPES:
            raise ValueError(
                f"dtype {str(cache.dtype).removeprefix('torch.')} is not supported by attention_backend 'flashinfer' "
                "(its kernels take bfloat16 or float16); use dtype bfloat16, float16 or auto, or attention_backend 'torch'"
            )
        device = cache.k[0].device
        if device.type not in DEVICE_TYPES:
            raise ValueError("attention_backend 'flashinfer' needs a CUDA device; use 'torch' on CPU")
        import flashinfer  # optional: the `cuda` extra

        self.kv_heads = cache.k[0].shape[2]
        self.kinds, self._kind_of = layer_kinds(self.layers)  # distinct LayerAttentions; each layer's index into them
        self.use_tensor_cores = uses_tensor_cores(num_heads, self.kv_heads)
        # The decode docstring asks for a zeroed workspace on first use.
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)
        # one wrapper per kind (a wrapper holds one plan: one scale, window and cap)
        self._prefill = [flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD") for _ in self.kinds]
        self._decode = [
            flashinfer.BatchDecodeWithPagedKVCacheWrapper(self._workspace, "NHD", use_tensor_cores=self.use_tensor_cores)
            for _ in self.kinds
        ]
        self._layer_wrappers: list[Any] = [self._decode[i] for i in self._kind_of]

    def init_forward(self, meta: AttentionMetadata) -> None:
        decode = all(n == 1 for n in meta.qo_lens)
        self.init_forward_with(meta, self._decode if decode else self._prefill)

    def init_forward_with(self, meta: AttentionMetadata, wrappers: Sequence[Any]) -> None:
        """init_forward through chosen wrappers, one per kind (`self.kinds`, in order): our prefill
        or decode ones, or a graph's from `graph_decode_wrappers` (planned here, outside its
        graph, before every replay).

        NOTE: plan() is host work (it schedules the split-KV partition from the host
        indptr), so it must never run inside a CUDA graph capture.
        """
        if len(wrappers) != len(self.kinds):
            raise ValueError(f"{len(wrappers)} wrappers for {len(self.kinds)} attention kinds: give one per kind")
        self.meta = meta
        kv, ps = paged_kv(meta), meta.page_size
        # q stays in the model's dtype; an fp8 pool is read as fp8 (k_scale / v_scale passed to run)
        dtypes = dict(q_data_type=self.cache.dtype, kv_data_type=self.cache.storage_dtype)
        if wrappers is not self._prefill:  # decode wrappers, ours or a graph's
            for kind, w in zip(self.kinds, wrappers):
                w.plan(kv.indptr, kv.indices, kv.last_page_len, self.num_heads, self.kv_heads, self.head_dim, ps,
                       **dtypes, **plan_options(kind))
        else:
            qo_indptr = host_int32([0, *itertools.accumulate(meta.qo_lens)], kv.indices.device)  # [B + 1]
            masks = dict(custom_mask=custom_mask(meta), causal=False) if meta.trees else dict(causal=True)
            for kind, w in zip(self.kinds, wrappers):
                w.plan(qo_indptr, kv.indptr, kv.indices, kv.last_page_len, self.num_heads, self.kv_heads, self.head_dim,
                       ps, **masks, **dtypes, **plan_options(kind))
        self._layer_wrappers = [wrappers[i] for i in self._kind_of]

    def graph_decode_wrappers(self, kv_indptr: torch.Tensor, kv_indices: torch.Tensor, last_page_len: torch.Tensor) -> list[Any]:
        """Decode wrappers for one CUDA graph, one per kind, its batch size B fixed at len(last_page_len).

        The int32 buffers are the caller's and must outlive the graph: kv_indptr [B + 1],
        kv_indices [at least the pages one step may list], last_page_len [B]. The kinds share
        them: each plan (`init_forward_with`) copies the same page table into them; the
        captured kernels read them there. Same kernel choice (tensor cores or not) as the eager
        decode wrappers.
        """
        import flashinfer

        return [
            flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_cuda_graph=True, use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=kv_indptr, paged_kv_indices_buffer=kv_indices,
                paged_kv_last_page_len_buffer=last_page_len,
            )
            for _ in self.kinds
        ]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
        self.cache.write(layer, self.meta.out_slots, k, v)
        return self._layer_wrappers[layer].run(
            q, (self.cache.k[layer], self.cache.v[layer]), k_scale=self.cache.k_scale[layer], v_scale=self.cache.v_scale[layer]
        )


# -- the kernels a configuration compiles ---------------------------------------------------------

@dataclass(frozen=True)
class JitModule:
    """One FlashInfer kernel module that this backend's plans load, compiled on first use unless
    built ahead (scripts/gpu_check.sh builds the whole list in one parallel build).

    As FlashInfer 0.6.13 chooses (decode.py / prefill.py, read at that version): decode is its
    CUDA-core decode module, or under tensor cores its prefill module in fa2; paged (and ragged)
    prefill with backend "auto" takes fa3 on SM90 when q and KV share a 16-bit dtype (FA3 wants an
    fp8 query for fp8 KV), else fa2. Windows and soft caps are compile-time switches.
    """

    kind: str  # "decode" or "prefill"
    backend: str  # prefill only: "fa2" or "fa3"; "" for decode
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    head_dim: int
    window: bool
    softcap: bool


def jit_modules(
    num_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype,
    layers: Sequence[LayerAttention], sm90: bool = True,
) -> list[JitModule]:
    """The modules a FlashInferBackend of this shape plans, decode and prefill, for every kind among
    `layers`, in first-use order without repeats. Raises ValueError naming what FlashInfer has no
    kernel for (head_dim, dtypes, a head count that is not a whole number of KV heads)."""
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim}: FlashInfer's kernels take {', '.join(map(str, HEAD_DIMS))}")
    if dtype not in Q_DTYPES:
        raise ValueError(f"dtype {dtype}: FlashInfer's kernels take bfloat16 or float16 queries")
    if kv_dtype != dtype and kv_dtype not in FP8_DTYPES:
        raise ValueError(f"kv dtype {kv_dtype}: FlashInfer reads the model's dtype ({dtype}) or fp8")
    if num_heads < 1 or kv_heads < 1 or num_heads % kv_heads:
        raise ValueError(f"{num_heads} query heads over {kv_heads} KV heads: need a whole number of query heads per KV head")
    prefill = "fa3" if sm90 and kv_dtype == dtype else "fa2"
    mods: list[JitModule] = []
    for la in layer_kinds(layers)[0]:
        opts = dict(q_dtype=dtype, kv_dtype=kv_dtype, head_dim=head_dim, window=la.window is not None,
                    softcap=la.softcap is not None)
        decode = JitModule("prefill", "fa2", **opts) if uses_tensor_cores(num_heads, kv_heads) else JitModule("decode", "", **opts)
        for m in (decode, JitModule("prefill", prefill, **opts)):
            if m not in mods:
                mods.append(m)
    return mods


def jit_specs(modules: Sequence[JitModule]) -> list[Any]:
    """FlashInfer's JitSpecs for `modules` (flashinfer.jit; constructing one writes its generated
    sources under FlashInfer's workspace, compiling is `flashinfer.jit.build_jit_specs`)."""
    from flashinfer.jit import gen_batch_decode_module, gen_batch_prefill_module

    specs = []
    for m in modules:
        common = (m.q_dtype, m.kv_dtype, m.q_dtype, torch.int32, m.head_dim, m.head_dim, 0, m.window, m.softcap)
        if m.kind == "decode":
            specs.append(gen_batch_decode_module(*common))
        else:
            specs.append(gen_batch_prefill_module(m.backend, *common, False))  # False: no fp16 QK reduction
    return specs

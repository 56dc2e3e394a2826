"""Per-layer attention options (LayerAttention: scale, sliding window, soft cap) in the backends,
against a naive float64 attention that builds the mask and the cap explicitly (HF's order: scale,
cap, then kv_idx <= q_idx and kv_idx > q_idx - window, then the softmax).

One step mixes every path a layer can take: prefills with no prefix (longer and shorter than the
window), prefill chunks over a cached prefix longer than the window, decodes of all lengths, and
decodes sharing prefix pages (a cascade group, which a window shorter than a member's sequence
takes the member out of). Five layers, five kinds: full with a custom scale, sliding + capped,
sliding with a window that cuts some requests, one no request outgrows (plans as full), and
capped full. TorchBackend on the CPU (compiled kernel and torch decode path, fp32 and bf16
pools, page size 1 and 16, GQA); FlashInferBackend against the same reference on a CUDA GPU
(skips without one).
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from radixrt.kernels import AttentionMetadata, LayerAttention, PagedKVCache, create_attention_backend
from radixrt.kernels import torch_backend
from radixrt.kernels.backend import layer_kinds
from radixrt.kernels.torch_backend import TorchBackend
from support.kernels import NATIVE, backend_device, use_path
from support.oracle import naive_attention

HEADS, KV_HEADS = 8, 2
SHARED = 80  # prefix tokens the cascade requests share (whole pages at 1 and 16)


def kinds_for(D: int) -> list[LayerAttention]:
    """One layer of each kind. Scales of 0.5 make unit-variance scores large enough for a cap of 2 to bite."""
    return [
        LayerAttention(scale=0.3),  # full, custom scale
        LayerAttention(scale=0.5 / math.sqrt(D / 16), window=8, softcap=2.0),  # sliding + capped (Gemma 2's local)
        LayerAttention(scale=D**-0.5, window=100),  # cuts the longer requests only
        LayerAttention(scale=D**-0.5, window=500),  # longer than every sequence: plans as full
        LayerAttention(scale=0.5 / math.sqrt(D / 16), softcap=2.0),  # full + capped (Gemma 2's global)
    ]


# (cached prefix, new tokens, shares the SHARED prefix pages)
STEP = [
    (0, 30, False),  # prefill, no prefix, longer than window 8
    (50, 12, False),  # chunk over a prefix longer than window 8
    (0, 5, False),  # short prefill: no window cuts it
    (120, 10, False),  # chunk over a prefix longer than window 100
    (0, 1, False), (6, 1, False), (8, 1, False), (44, 1, False), (150, 1, False),  # decodes (kv 1 .. 151)
    (SHARED, 1, True), (SHARED + 16, 1, True), (SHARED + 39, 1, True),  # cascade; the last outgrows window 100
]
DECODES_ONLY = [s for s in STEP if s[1] == 1]


def run_step(backend, cache: PagedKVCache, step, page_size: int, D: int, seed: int) -> None:
    """Write each request's cached prefix, run one step through every layer, hold each output to `naive`."""
    device, dtype = cache.k[0].device, cache.dtype
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).float()  # noqa: E731  values the pool holds exactly
    layers = len(cache.k)
    free = list(range(cache.num_pages))
    random.Random(seed).shuffle(free)
    shared_pages = [free.pop() for _ in range(SHARED // page_size)]
    shared_kv = [(rand(SHARED, KV_HEADS, D), rand(SHARED, KV_HEADS, D)) for _ in range(layers)]
    tables, history = [], []  # history[r][layer]: (k, v) [prefix, kv_heads, D]
    for prefix, new, shares in step:
        own_from = SHARED if shares else 0
        own_pages = [free.pop() for _ in range(math.ceil((prefix + new - own_from) / page_size))]
        tables.append((shared_pages if shares else []) + own_pages)
        hist = []
        for layer in range(layers):
            k, v = rand(prefix, KV_HEADS, D), rand(prefix, KV_HEADS, D)
            if shares:
                k[:SHARED], v[:SHARED] = shared_kv[layer]
            hist.append((k, v))
        history.append(hist)
    width = max(len(t) for t in tables)
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots_of = lambda r, pos: page_table[r, pos // page_size] * page_size + pos % page_size  # noqa: E731
    for r, (prefix, _, _) in enumerate(step):
        for layer in range(layers):
            cache.write(layer, slots_of(r, torch.arange(prefix)).to(device), *(x.to(device, dtype) for x in history[r][layer]))
    out_slots = torch.cat([slots_of(r, torch.arange(p, p + n)) for r, (p, n, _) in enumerate(step)])
    qo_lens, kv_lens = [n for _, n, _ in step], [p + n for p, n, _ in step]
    meta = AttentionMetadata(qo_lens, kv_lens, page_table.to(device), out_slots.to(device), page_size)
    backend.init_forward(meta)
    T = len(out_slots)
    tol = 2e-2 if dtype == torch.bfloat16 or device.type == "cuda" else 2e-5
    for layer, la in enumerate(backend.layers):
        q, k, v = rand(T, HEADS, D), rand(T, KV_HEADS, D), rand(T, KV_HEADS, D)
        got = backend.forward(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), layer).float().cpu()
        row = 0
        for r, (prefix, new, _) in enumerate(step):
            hk, hv = history[r][layer]
            want = naive_attention(q[row : row + new], torch.cat([hk, k[row : row + new]]), torch.cat([hv, v[row : row + new]]),
                                   la.scale, la.window, la.softcap)
            where = f"layer {layer} ({la}), request {r}"
            torch.testing.assert_close(got[row : row + new].double(), want, atol=tol, rtol=tol, msg=lambda m: f"{where}: {m}")
            row += new


def make_cache(page_size: int, D: int, dtype: torch.dtype, device: torch.device, layers: int) -> PagedKVCache:
    num_pages = sum(math.ceil((p + n) / page_size) for p, n, _ in STEP) + 8
    return PagedKVCache(layers, num_pages, page_size, KV_HEADS, D, dtype, device)


@pytest.mark.parametrize("path", [*NATIVE, "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_torch_backend_layer_options_match_naive(path, dtype, page_size, monkeypatch):
    native = use_path(path, monkeypatch)
    # small score blocks: the capped prefill path splits a chunk's queries into several blocks
    monkeypatch.setattr(torch_backend, "CAPPED_SCORES_PER_BLOCK", 4096)
    D = 32
    layers = kinds_for(D)
    cache = make_cache(page_size, D, dtype, torch.device("cpu"), len(layers))
    backend = TorchBackend(cache, HEADS, D, layers, native=native)
    run_step(backend, cache, STEP, page_size, D, seed=page_size)
    plans = backend.layer_plans
    # plans follow the window, not the layer: full, capped full and the uncut window share one
    assert plans[0] is plans[3] is plans[4] and len({id(p) for p in plans}) == 3
    cascade_rows = lambda plan: plan.cascade_groups()  # noqa: E731
    first = sum(n for _, n, _ in STEP[:-3])  # token row of the first cascade request
    assert cascade_rows(plans[0]) == [[first, first + 1, first + 2]]
    assert cascade_rows(plans[1]) == []  # window 8: no member reads the shared prefix whole
    assert cascade_rows(plans[2]) == [[first, first + 1]]  # window 100: the third (kv 120) decodes alone
    if native:  # chunks and decodes in one call, each chunk's queries reading causally (the kernel applies the window)
        assert all(not p.prefills and len(p.decodes) == 1 and p.decodes[0].q_starts is not None for p in plans)
        return
    # a chunk over a prefix longer than the window reads only the KV its queries see
    chunk = plans[1].prefills[1]  # (50, 12) under window 8: positions 43 .. 61
    assert chunk.slots.shape == (19,) and chunk.mask.shape == (12, 19)
    assert plans[0].prefills[0].slots is None and plans[0].prefills[0].mask is None  # full: today's plain causal path


def test_torch_backend_decode_only_step_under_windows():
    """A step of decodes alone (the common case): the compiled kernel's window read, once per window."""
    D = 64
    layers = kinds_for(D)
    cache = make_cache(16, D, torch.float32, torch.device("cpu"), len(layers))
    backend = TorchBackend(cache, HEADS, D, layers)
    run_step(backend, cache, DECODES_ONLY, 16, D, seed=5)
    assert all(not p.prefills for p in backend.layer_plans)


@pytest.mark.cuda
@pytest.mark.parametrize("shapes", [STEP, DECODES_ONLY], ids=["mixed", "decode"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_layer_options_match_naive(shapes, page_size):
    """FlashInfer: one wrapper per kind, window_left = window - 1, logits_soft_cap, sm_scale."""
    device, dtype, _ = backend_device("flashinfer")
    D = 64
    layers = kinds_for(D)
    cache = make_cache(page_size, D, dtype, device, len(layers))
    backend = create_attention_backend("flashinfer", cache, HEADS, D, layers)
    assert len(backend.kinds) == len(layers)
    run_step(backend, cache, shapes, page_size, D, seed=page_size + 1)


def test_layer_attention_validates_and_groups_into_kinds():
    full, sliding = LayerAttention(0.125), LayerAttention(0.125, window=4096, softcap=50.0)
    kinds, kind_of = layer_kinds([sliding, full] * 3)
    assert kinds == [sliding, full] and kind_of == [0, 1] * 3
    assert sliding.sees_all(4096) and not sliding.sees_all(4097) and full.sees_all(10**9)
    for bad in (dict(scale=0.0), dict(scale=1.0, window=0), dict(scale=1.0, softcap=-1.0)):
        with pytest.raises(ValueError, match=next(iter(bad.keys() - {"scale"}), "scale")):
            LayerAttention(**bad)
    cache = PagedKVCache(2, 4, 1, 1, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="1 LayerAttentions for a KV cache of 2 layers"):
        TorchBackend(cache, 1, 8, [full], native=False)
    with pytest.raises(TypeError, match="sequence of LayerAttention"):
        TorchBackend(cache, 1, 8, 0.125, native=False)

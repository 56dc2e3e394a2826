"""Attention backends against a naive per-token attention over the same pages: TorchBackend
on the CPU, and FlashInferBackend on a CUDA GPU (those cases skip, saying why, without one).

Covers what top-left causal masks get wrong: new tokens over an already
cached prefix (radix hits, later prefill chunks), mixed with decodes, GQA, and
page tables whose pages are scattered.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from radixrt.kernels import AttentionMetadata, LayerAttention, PagedKVCache, create_attention_backend
from support.kernels import backend_device
from support.oracle import naive_attention


MIXED = [(0, 7), (13, 5), (20, 1), (1, 1), (0, 1), (37, 9), (64, 1)]  # plain prefill, over a prefix, decodes
DECODES = [(20, 1), (1, 1), (0, 1), (64, 1), (37, 1)]


@pytest.mark.parametrize("backend_name", ["torch", pytest.param("flashinfer", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("shapes", [MIXED, DECODES], ids=["mixed", "decode"])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 2)])
def test_batch_matches_naive(backend_name, shapes, page_size, heads, kv_heads):
    device, dtype, tol = backend_device(backend_name)
    torch.manual_seed(0)
    rng = random.Random(page_size * 10 + heads)
    D, layers, num_pages = 16 if backend_name == "torch" else 64, 2, 256
    cache = PagedKVCache(layers, num_pages, page_size, kv_heads, D, dtype, device)
    backend = create_attention_backend(backend_name, cache, heads, D, [LayerAttention(D**-0.5)] * layers)
    # (cached prefix, new tokens) per request
    free = list(range(num_pages))
    rng.shuffle(free)
    tables, history = [], []
    for prefix, new in shapes:
        n_pages = math.ceil((prefix + new) / page_size)
        tables.append([free.pop() for _ in range(n_pages)])
        history.append([(torch.randn(prefix, kv_heads, D), torch.randn(prefix, kv_heads, D)) for _ in range(layers)])
    max_pages = max(len(t) for t in tables)
    page_table = torch.tensor([t + [0] * (max_pages - len(t)) for t in tables])
    slots_of = lambda i, pos: page_table[i, pos // page_size] * page_size + pos % page_size  # noqa: E731
    for layer in range(layers):  # the cached prefixes, written as earlier steps would have
        for i, (prefix, _) in enumerate(shapes):
            hk, hv = history[i][layer]
            cache.write(layer, slots_of(i, torch.arange(prefix)).to(device), hk.to(device, dtype), hv.to(device, dtype))
    out_slots = torch.cat([slots_of(i, torch.arange(p, p + n)) for i, (p, n) in enumerate(shapes)])
    meta = AttentionMetadata([n for _, n in shapes], [p + n for p, n in shapes], page_table.to(device), out_slots.to(device), page_size)
    backend.init_forward(meta)
    T = sum(n for _, n in shapes)
    for layer in range(layers):
        q, k, v = (torch.randn(T, h, D).to(dtype).float() for h in (heads, kv_heads, kv_heads))
        got = backend.forward(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), layer).float().cpu()
        row = 0
        for i, (prefix, new) in enumerate(shapes):
            hk, hv = (x.to(dtype).float() for x in history[i][layer])
            k_all, v_all = torch.cat([hk, k[row : row + new]]), torch.cat([hv, v[row : row + new]])
            want = naive_attention(q[row : row + new], k_all, v_all, D**-0.5).float()
            torch.testing.assert_close(got[row : row + new], want, atol=tol, rtol=tol)
            row += new


def test_unknown_backend_is_named():
    cache = PagedKVCache(1, 4, 1, 1, 8, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="nonesuch"):
        create_attention_backend("nonesuch", cache, 1, 8, [LayerAttention(1.0)])


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decodes_sharing_prefix_pages_attend_in_cascade_exactly(page_size, dtype):
    """Requests whose page tables start with the same pages (a radix hit) read that prefix once."""
    from radixrt.kernels.attention_plan import CASCADE_MIN_TOKENS

    torch.manual_seed(1)
    heads, kv_heads, D, layers, num_pages = 8, 2, 16, 2, 512 // page_size + 64
    cache = PagedKVCache(layers, num_pages, page_size, kv_heads, D, dtype, torch.device("cpu"))
    backend = create_attention_backend("torch", cache, heads, D, [LayerAttention(D**-0.5)] * layers)
    shared_len = 96  # whole pages at both page sizes, >= CASCADE_MIN_TOKENS
    assert shared_len >= CASCADE_MIN_TOKENS
    free = list(range(num_pages))
    random.Random(3).shuffle(free)
    shared_pages = [free.pop() for _ in range(shared_len // page_size)]
    # kv_len of each decode after this step: the first three share the prefix pages, the
    # last two have pages of their own; plus one fresh prefill.
    kv_lens = [shared_len + 1, shared_len + 7, shared_len + 30, 40, 55]
    tables, seqs = [], []
    prefix_k = [torch.randn(shared_len, kv_heads, D).to(dtype) for _ in range(layers)]
    prefix_v = [torch.randn(shared_len, kv_heads, D).to(dtype) for _ in range(layers)]
    for i, n in enumerate(kv_lens):
        own_from = shared_len if i < 3 else 0
        pages = (shared_pages if i < 3 else []) + [free.pop() for _ in range(math.ceil((n - own_from) / page_size))]
        tables.append(pages)
    tables.append([free.pop() for _ in range(2)])  # a fresh prefill of 20 tokens
    max_pages = max(len(t) for t in tables)
    page_table = torch.tensor([t + [0] * (max_pages - len(t)) for t in tables])
    slots_of = lambda i, pos: page_table[i, pos // page_size] * page_size + pos % page_size  # noqa: E731
    for layer in range(layers):  # history before this step; the shared prefix written once
        cache.write(layer, slots_of(0, torch.arange(shared_len)), prefix_k[layer], prefix_v[layer])
        hist = []
        for i, n in enumerate(kv_lens):
            start = shared_len if i < 3 else 0
            k, v = torch.randn(n - 1 - start, kv_heads, D).to(dtype), torch.randn(n - 1 - start, kv_heads, D).to(dtype)
            cache.write(layer, slots_of(i, torch.arange(start, n - 1)), k, v)
            hist.append((torch.cat([prefix_k[layer], k]) if i < 3 else k, torch.cat([prefix_v[layer], v]) if i < 3 else v))
        seqs.append(hist)
    qo_lens = [1] * len(kv_lens) + [20]
    all_kv = kv_lens + [20]
    out_slots = torch.cat([slots_of(i, torch.tensor([n - 1])) for i, n in enumerate(kv_lens)] + [slots_of(5, torch.arange(20))])
    backend.init_forward(AttentionMetadata(qo_lens, all_kv, page_table, out_slots, page_size))
    assert backend.layer_plans[0].cascade_groups() == [[0, 1, 2]]
    T = sum(qo_lens)
    for layer in range(layers):
        q = torch.randn(T, heads, D).to(dtype)
        k, v = torch.randn(T, kv_heads, D).to(dtype), torch.randn(T, kv_heads, D).to(dtype)
        got = backend.forward(q, k, v, layer)
        for i in range(len(kv_lens)):
            hk, hv = seqs[layer][i]
            want = naive_attention(q[i : i + 1], torch.cat([hk, k[i : i + 1]]), torch.cat([hv, v[i : i + 1]]),
                                   D**-0.5).float()
            tol = 1e-5 if dtype == torch.float32 else 2e-2
            torch.testing.assert_close(got[i : i + 1].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shapes", [MIXED, DECODES, [(3, 1), (0, 300)]], ids=["mixed", "decode", "long"])  # long: threads convert
@pytest.mark.parametrize("window,softcap", [(None, None), (24, 30.0)])
def test_the_layer_entry_stores_and_attends_as_the_general_path(dtype, shapes, window, softcap):
    """One call per layer (native_attention.LayerStep: the new K/V stored, then the kernel) gives the same
    output and the same pool, bit for bit, as the store and the kernel called apart; q, k and v are views of
    one fused projection's rows, as the model hands them over. Decodes come first, as the scheduler
    orders a step (a chunk before a decode leaves the general path's gather to it)."""
    shapes = sorted(shapes, key=lambda s: s[1] > 1)
    heads, kv_heads, D, page_size, layers = 8, 2, 32, 4, 2
    las = [LayerAttention(D**-0.5, window=window, softcap=softcap)] * layers
    caches = [PagedKVCache(layers, 128, page_size, kv_heads, D, dtype, torch.device("cpu")) for _ in range(2)]
    backends = [create_attention_backend("torch", c, heads, D, las) for c in caches]
    if backends[0].kernels is None:
        pytest.skip("no variant of the compiled attention kernel builds here")
    torch.manual_seed(1)
    for c in caches:  # the same cached prefixes in both
        for i, buf in enumerate(c.k + c.v):
            buf.copy_(torch.randn(buf.shape, generator=torch.Generator().manual_seed(i)).to(dtype))
    order = torch.randperm(128)
    tables, at = [], 0
    for prefix, new in shapes:
        n = math.ceil((prefix + new) / page_size)
        tables.append(order[at : at + n].tolist())
        at += n
    width = max(len(t) for t in tables)
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    out_slots = torch.cat([page_table[i, pos // page_size] * page_size + pos % page_size
                           for i, (p, n) in enumerate(shapes) for pos in [torch.arange(p, p + n)]])
    meta = AttentionMetadata([n for _, n in shapes], [p + n for p, n in shapes], page_table, out_slots, page_size)
    for b in backends:
        b.init_forward(meta)
    assert all(s is not None for s in backends[0].layer_steps)
    backends[1].layer_steps = [None] * layers  # the general path: the store, then the kernel
    T = sum(n for _, n in shapes)
    for layer in range(layers):
        qkv = torch.randn(T, (heads + 2 * kv_heads) * D).to(dtype)
        q, k, v = qkv.split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
        q, k, v = q.view(T, heads, D), k.view(T, kv_heads, D), v.view(T, kv_heads, D)
        got, want = (b.forward(q, k, v, layer) for b in backends)
        assert got.dtype == dtype and torch.equal(got, want)
    for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
        assert torch.equal(a, b)

"""Attention mass (heavy-hitter retention): attention_mass.token_mass against a naive per-head
softmax with the mask built by hand, and TorchBackend.take_page_mass over a real paged cache
(fp32, bf16 and int8 pools, compiled and torch decode paths, page sizes 4 and 16) against the
naive per-page sums by position, on a mixed batch whose page tables are scattered and out of
order; asking for mass never changes an attention output.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from radixrt.kernels import AttentionBackend, AttentionMetadata, LayerAttention, PagedKVCache
from radixrt.kernels import attention_mass
from radixrt.kernels.attention_mass import token_mass
from radixrt.kernels.kv_cache import quantize_int8
from radixrt.kernels.torch_backend import TorchBackend
from support.kernels import require_native

HEADS, KV_HEADS, D = 8, 2, 16


def naive_mass(q, k, prefix: int, la: LayerAttention) -> torch.Tensor:
    """q: [n, H, D]; k: [prefix + n, Hkv, D]; new token i at position prefix + i -> [prefix + n] float64."""
    n, H, _ = q.shape
    T, group = k.shape[0], H // k.shape[1]
    mass = torch.zeros(T, dtype=torch.float64)
    for h in range(H):
        s = q[:, h].double() @ k[:, h // group].double().T * la.scale  # [n, T]
        if la.softcap is not None:
            s = la.softcap * torch.tanh(s / la.softcap)
        for i in range(n):
            p = prefix + i
            seen = [t for t in range(T) if t <= p and (la.window is None or t > p - la.window)]
            e = torch.exp(s[i, seen] - s[i, seen].max())
            mass[seen] += e / e.sum()
    return mass


CASES = {  # (heads, kv_heads, prefix, new, LayerAttention)
    "gqa": (8, 2, 0, 9, LayerAttention(0.25)),
    "prefix": (4, 4, 7, 5, LayerAttention(0.25)),
    "window": (8, 2, 20, 6, LayerAttention(0.25, window=5)),
    "softcap": (4, 2, 3, 4, LayerAttention(0.6, softcap=2.0)),
    "window+softcap": (6, 3, 11, 1, LayerAttention(0.6, window=4, softcap=1.5)),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_token_mass_matches_naive(case, monkeypatch):
    monkeypatch.setattr(attention_mass, "MASS_SCORES_PER_BLOCK", 256)  # several row blocks
    H, Hkv, prefix, n, la = CASES[case]
    g = torch.Generator().manual_seed(len(case))
    q, k = torch.randn(n, H, D, generator=g), torch.randn(prefix + n, Hkv, D, generator=g)
    got = token_mass(q, k, prefix + torch.arange(n), torch.arange(prefix + n), la)
    assert got.dtype == torch.float32 and got.shape == (prefix + n,)
    torch.testing.assert_close(got.double(), naive_mass(q, k, prefix, la), atol=1e-5, rtol=1e-5)
    assert math.isclose(float(got.sum()), n * H, rel_tol=1e-5)


def test_page_mass_folds_by_position():
    got = attention_mass.page_mass(torch.arange(10.0), 4)
    assert got.tolist() == [6.0, 22.0, 17.0]


LAYERS = [LayerAttention(D**-0.5), LayerAttention(0.5, window=6, softcap=2.0)]
# (cached prefix, new tokens): decodes of two lengths, a chunk over a prefix, a prefill with none
STEP = [(9, 1), (30, 1), (13, 6), (0, 7)]
MASS_REQS = [3, 0, 2]  # a subset, out of batch order


def dequantized(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x: [T, kv_heads, D] -> what an int8 pool reads back (in dtype), as float32."""
    values, scales = quantize_int8(x)
    return (values.float() * scales[..., None]).to(dtype).float()


def build_step(cache: PagedKVCache, step, tables: list[list[int]], seed: int):
    """Write each request's prefix into its pages; the step's metadata and per-layer (q, k, v) and
    each request's K by position (as the pool gives it back) for the reference."""
    dtype, ps = cache.dtype, cache.page_size
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g).to(dtype).float()  # noqa: E731  exact in the pool's dtype
    width = max(len(t) for t in tables)
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots_of = lambda r, pos: page_table[r, pos // ps] * ps + pos % ps  # noqa: E731
    T = sum(n for _, n in step)
    inputs, keys = [], []  # inputs[layer]: (q, k, v); keys[layer][r]: [kv_len, kv_heads, D]
    for layer in range(len(cache.k)):
        hist = [(rand(p, KV_HEADS, D), rand(p, KV_HEADS, D)) for p, _ in step]
        for r, (p, _) in enumerate(step):
            cache.write(layer, slots_of(r, torch.arange(p)), *(x.to(dtype) for x in hist[r]))
        q, k, v = rand(T, HEADS, D), rand(T, KV_HEADS, D), rand(T, KV_HEADS, D)
        inputs.append((q.to(dtype), k.to(dtype), v.to(dtype)))
        starts = [sum(n for _, n in step[:r]) for r in range(len(step))]
        keys.append([torch.cat([hist[r][0], k[s : s + n]]) for r, ((_, n), s) in enumerate(zip(step, starts))])
    if cache.kv_dtype == "int8":  # the reference sees what the pool reads back: quantized, then dequantized
        keys = [[dequantized(x, dtype) for x in per] for per in keys]
    out_slots = torch.cat([slots_of(r, torch.arange(p, p + n)) for r, (p, n) in enumerate(step)])
    meta = AttentionMetadata([n for _, n in step], [p + n for p, n in step], page_table, out_slots, ps)
    return meta, inputs, keys


def run(backend: AttentionBackend, meta: AttentionMetadata, inputs) -> list[torch.Tensor]:
    backend.init_forward(meta)
    return [backend.forward(q, k, v, layer) for layer, (q, k, v) in enumerate(inputs)]


def scattered_tables(step, page_size: int, num_pages: int, seed: int) -> list[list[int]]:
    free = list(range(num_pages))
    random.Random(seed).shuffle(free)
    # scattered pages, each row in descending order: page-table column order is not page-id order
    return [sorted((free.pop() for _ in range(math.ceil((p + n) / page_size))), reverse=True) for p, n in step]


def assert_page_mass(got: list[torch.Tensor], meta, keys, inputs, step, mass_reqs, tol: float) -> None:
    assert len(got) == len(mass_reqs)
    starts = [sum(n for _, n in step[:r]) for r in range(len(step))]
    for m, r in zip(got, mass_reqs):
        (prefix, n), kv_len = step[r], meta.kv_lens[r]
        want = sum(naive_mass(inputs[layer][0][starts[r] : starts[r] + n].float(), keys[layer][r], prefix, la)
                   for layer, la in enumerate(LAYERS))
        want_pages = torch.zeros(math.ceil(kv_len / meta.page_size), dtype=torch.float64)
        want_pages.index_add_(0, torch.arange(kv_len) // meta.page_size, want)
        assert m.dtype == torch.float32 and m.shape == want_pages.shape
        torch.testing.assert_close(m.double(), want_pages, atol=tol, rtol=tol, msg=lambda e: f"request {r}: {e}")
        assert math.isclose(float(m.sum()), n * HEADS * len(LAYERS), rel_tol=1e-5)


@pytest.mark.parametrize("native", [None, False], ids=["default", "torch-decode"])
@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.float32, "int8")],
                         ids=["fp32", "bf16", "int8"])
@pytest.mark.parametrize("page_size", [4, 16])
def test_torch_backend_page_mass_matches_naive(native, dtype, kv_dtype, page_size):
    if native is None and kv_dtype == "auto":
        require_native()
    num_pages = sum(math.ceil((p + n) / page_size) for p, n in STEP) + 8
    cache = PagedKVCache(len(LAYERS), num_pages, page_size, KV_HEADS, D, dtype, torch.device("cpu"), kv_dtype)
    backend = TorchBackend(cache, HEADS, D, LAYERS, native=native)
    assert backend.reports_attention_mass
    meta, inputs, keys = build_step(cache, STEP, scattered_tables(STEP, page_size, num_pages, page_size), seed=page_size)
    plain = run(backend, meta, inputs)  # mass_reqs empty: the step as it always ran
    assert backend.take_page_mass() == []
    meta.mass_reqs = MASS_REQS  # the same step again (rewriting the same K/V) with mass wanted
    with_mass = run(backend, meta, inputs)
    for layer in range(len(LAYERS)):
        assert torch.equal(plain[layer], with_mass[layer]), f"layer {layer}: asking for mass changed the output"
    assert_page_mass(backend.take_page_mass(), meta, keys, inputs, STEP, MASS_REQS, tol=1e-4)
    backend.init_forward(AttentionMetadata(meta.qo_lens, meta.kv_lens, meta.page_table, meta.out_slots, page_size))
    assert backend.take_page_mass() == []  # the next step restarts the count


def test_page_table_row_is_the_whole_kv_in_column_order():
    """Retention drops middle pages: the remaining pages, in column order, are the request's KV."""
    page_size, tables, step = 4, [[7, 2, 5], [1, 0]], [(10, 1), (3, 5)]
    cache = PagedKVCache(len(LAYERS), 8, page_size, KV_HEADS, D, torch.float32, torch.device("cpu"))
    backend = TorchBackend(cache, HEADS, D, LAYERS, native=False)
    meta, inputs, keys = build_step(cache, step, tables, seed=1)
    meta.mass_reqs = [0, 1]
    run(backend, meta, inputs)
    assert_page_mass(backend.take_page_mass(), meta, keys, inputs, step, [0, 1], tol=1e-5)


def test_metadata_defaults_and_base_backend_does_not_report():
    meta = AttentionMetadata([1], [1], torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 4)
    assert meta.mass_reqs == []

    class Plain(AttentionBackend):
        def init_forward(self, meta):
            pass

        def forward(self, q, k, v, layer):
            return q

    cache = PagedKVCache(1, 2, 4, KV_HEADS, D, torch.float32, torch.device("cpu"))
    backend = Plain(cache, HEADS, D, [LayerAttention(1.0)])
    assert not backend.reports_attention_mass
    with pytest.raises(NotImplementedError, match="Plain does not report attention mass"):
        backend.take_page_mass()

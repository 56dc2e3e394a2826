"""The CPU decode paths against naive per-token attention in float64 over the K/V the pool
holds: the compiled kernel reading the pool in place (native_attention.py, csrc/paged_attention.c)
and the torch path (grouped float32 matmuls over a head-major gather, decode_attention.py).

One decode batch per case: ragged KV lengths (several length groups, padding inside each),
two groups of requests sharing prefix pages of different lengths (the cascade path), over every page size, GQA group,
head_dim, model dtype and pool format the issue names. The reference reads each request's
K/V back through PagedKVCache.read, so a quantized pool is compared with what it stores:
the tolerance is the attention's, not the quantizer's.
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch
from radixrt.kernels import AttentionMetadata, LayerAttention, PagedKVCache
from radixrt.kernels import kernel_choice
from radixrt.kernels.native_build import ISA_ENV, ISAS
from radixrt.kernels.decode_attention import attend, merge
from radixrt.kernels.torch_backend import TorchBackend
from support.kernels import NATIVE, attention_tolerance, require_native, use_path
from support.oracle import naive_attention

KV_HEADS = 2
# Cascade groups: (their first request, members, tokens of prefix pages they share: whole pages at 1 and 16)
GROUPS = [(0, 3, 80), (3, 2, 64)]
# KV length of each request after this step; the groups' members extend their shared prefix
KV_LENS = [81, 97, 120, 67, 84, 1, 5, 16, 17, 33, 64, 100, 150]


def shared_of(i: int) -> tuple[int, int]:
    """(the group's first request, its shared tokens) for a member of a cascade group; (i, 0) otherwise."""
    return next(((first, shared) for first, n, shared in GROUPS if first <= i < first + n), (i, 0))


def build_batch(page_size: int, seed: int) -> tuple[torch.Tensor, int]:
    """Page tables [reqs, max_pages] with scattered pages; each of GROUPS shares its prefix's pages."""
    num_pages = sum(math.ceil(n / page_size) for n in KV_LENS) + 8
    free = list(range(num_pages))
    random.Random(seed).shuffle(free)
    prefixes = {first: [free.pop() for _ in range(shared // page_size)] for first, _, shared in GROUPS}
    tables = []
    for i, n in enumerate(KV_LENS):
        first, shared = shared_of(i)
        tables.append(prefixes.get(first, []) + [free.pop() for _ in range(math.ceil((n - shared) / page_size))])
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables]), num_pages


# (path, pool format): the compiled kernel serves float32/bf16, int4 (rotated keys) and int8 pools, dequantized
# in the kernel; the torch path every format
PATHS = [(n, kv) for kv in ("auto", "int4", "int8") for n in NATIVE] + [("torch", kv) for kv in ("auto", "int8", "fp8_e4m3", "int4")]


@pytest.mark.parametrize("path,kv_dtype", PATHS, ids=[f"{p}-{k}" for p, k in PATHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_batch_matches_naive(path, kv_dtype, dtype, page_size, group, head_dim, monkeypatch):
    native = use_path(path, monkeypatch)
    torch.manual_seed(page_size + group + head_dim)
    heads, layers, scale = KV_HEADS * group, 2, head_dim**-0.5
    page_table, num_pages = build_batch(page_size, seed=group * head_dim)
    cache = PagedKVCache(layers, num_pages, page_size, KV_HEADS, head_dim, dtype, torch.device("cpu"), kv_dtype)
    backend = TorchBackend(cache, heads, head_dim, [LayerAttention(scale)] * layers, native=native)
    slots_of = lambda i, pos: page_table[i, pos // page_size] * page_size + pos % page_size  # noqa: E731
    for layer in range(layers):  # history before this step (a shared prefix is written by each member: same values)
        prefix = {first: (torch.randn(shared, KV_HEADS, head_dim), torch.randn(shared, KV_HEADS, head_dim))
                  for first, _, shared in GROUPS}
        for i, n in enumerate(KV_LENS):
            k, v = torch.randn(n - 1, KV_HEADS, head_dim), torch.randn(n - 1, KV_HEADS, head_dim)
            first, shared = shared_of(i)
            if shared:
                k[:shared], v[:shared] = prefix[first]
            cache.write(layer, slots_of(i, torch.arange(n - 1)), k.to(dtype), v.to(dtype))
    out_slots = torch.cat([slots_of(i, torch.tensor([n - 1])) for i, n in enumerate(KV_LENS)])
    backend.init_forward(AttentionMetadata([1] * len(KV_LENS), KV_LENS, page_table, out_slots, page_size))
    assert backend.layer_plans[0].cascade_groups() == [list(range(first, first + n)) for first, n, _ in GROUPS]
    # the compiled kernel reads every group's prefix in one call and their tails in another
    assert (backend.layer_plans[0].native_cascades is not None) == native
    assert not backend.layer_plans[0].prefills
    # the kernel reads each request's own length in one call; the torch path pads, in length groups
    assert len(backend.layer_plans[0].decodes) == 1 if native else len(backend.layer_plans[0].decodes) >= 3
    if native:
        assert set(backend.kernels.names().values()) == {os.environ[ISA_ENV]}
    tol = attention_tolerance(dtype, backend, kv_dtype)
    for layer in range(layers):
        q = torch.randn(len(KV_LENS), heads, head_dim).to(dtype)
        k, v = torch.randn(len(KV_LENS), KV_HEADS, head_dim).to(dtype), torch.randn(len(KV_LENS), KV_HEADS, head_dim).to(dtype)
        got = backend.forward(q, k, v, layer)
        assert got.dtype == dtype
        for i, n in enumerate(KV_LENS):
            k_all, v_all = cache.read(layer, slots_of(i, torch.arange(n)))  # what the pool holds, new token included
            want = naive_attention(q[i], k_all, v_all, scale)
            torch.testing.assert_close(got[i].double(), want, atol=tol, rtol=tol)


def test_attend_masks_padding_and_merge_is_exact():
    """Two disjoint KV blocks merged by their log-sum-exps equal one attention over both;
    padding positions (bias -inf, zero K/V) contribute nothing."""
    torch.manual_seed(0)
    q = torch.randn(3, 2, 4, 32)  # [B, kv_heads, group, D]
    k, v = torch.randn(3, 2, 50, 32), torch.randn(3, 2, 50, 32)
    whole, lse = attend(q, k, v, None, 0.2)
    o1, l1 = attend(q, k[:, :, :20], v[:, :, :20], None, 0.2)
    o2, l2 = attend(q, k[:, :, 20:], v[:, :, 20:], None, 0.2)
    torch.testing.assert_close(merge(o1, l1, o2, l2), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.logaddexp(l1, l2), lse, atol=1e-5, rtol=1e-5)
    padded_k, padded_v = torch.cat([k, torch.zeros(3, 2, 7, 32)], 2), torch.cat([v, torch.zeros(3, 2, 7, 32)], 2)
    bias = torch.zeros(3, 1, 1, 57)
    bias[..., 50:] = float("-inf")
    torch.testing.assert_close(attend(q, padded_k, padded_v, bias, 0.2)[0], whole, atol=1e-6, rtol=1e-6)


def test_quantized_pools_take_the_torch_path():
    """fp8 pools and pools of two formats (K:V) dequantize through PagedKVCache.read; the kernel does not
    serve them (it does int4 and int8 pools: test_decode_batch_matches_naive)."""
    for kv_dtype in ("fp8_e4m3", "int8:int4"):
        cache = PagedKVCache(1, 4, 16, KV_HEADS, 64, torch.bfloat16, torch.device("cpu"), kv_dtype)
        assert TorchBackend(cache, 2 * KV_HEADS, 64, [LayerAttention(0.125)]).kernels is None
        with pytest.raises(RuntimeError, match="unavailable"):
            TorchBackend(cache, 2 * KV_HEADS, 64, [LayerAttention(0.125)], native=True)


def test_a_kernel_that_cannot_build_leaves_the_torch_path_and_says_why(tmp_path):
    """No compiler (CC names none) and nothing cached: the backend decodes through torch, logged."""
    import subprocess
    import sys

    code = (
        "import logging, torch; logging.basicConfig(level=logging.INFO)\n"
        "from radixrt.kernels import LayerAttention, PagedKVCache\n"
        "from radixrt.kernels.torch_backend import TorchBackend\n"
        "cache = PagedKVCache(1, 4, 16, 2, 64, torch.float32, torch.device('cpu'))\n"
        "assert TorchBackend(cache, 4, 64, [LayerAttention(0.125)]).kernels is None\n"
    )
    env = {"PATH": "/usr/bin:/bin", "CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "variant is unavailable" in done.stderr and "using the torch path" in done.stderr


def test_the_kernel_variant_follows_the_cpu_and_the_override(monkeypatch):
    """The best variant the CPU's flags allow whose vector lanes divide head_dim, unless
    RADIXRT_CPU_KERNEL_ISA names one; a name that is unknown, that the CPU cannot run, or whose
    lanes do not divide head_dim is an error, never a quiet downgrade."""
    from radixrt.kernels import native_build

    if len(ISAS) == 1:
        pytest.skip("not an x86 machine: only the scalar variant exists")
    avx512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "sse2"})
    monkeypatch.delenv(ISA_ENV, raising=False)
    monkeypatch.setattr(native_build, "cpu_flags", lambda: avx512)
    assert [native_build.chosen_isa(d).name for d in (64, 128, 40, 36)] == ["avx512", "avx512", "avx2", "scalar"]
    monkeypatch.setattr(native_build, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert native_build.chosen_isa(64).name == "avx2"
    with monkeypatch.context() as m:
        m.setenv(ISA_ENV, "avx512")
        with pytest.raises(ValueError, match="lacks avx512"):
            native_build.chosen_isa(64)
        m.setenv(ISA_ENV, "sse9")
        with pytest.raises(ValueError, match="not a kernel variant"):
            native_build.chosen_isa(64)
        m.setenv(ISA_ENV, "avx2")
        with pytest.raises(ValueError, match="multiple of 8"):
            kernel_choice.choose_kernels(kernel_choice.Shape(4, 2, 36, 16, torch.bfloat16))
        m.setenv(ISA_ENV, "Scalar")
        assert native_build.chosen_isa(64).name == "scalar"
    monkeypatch.setattr(native_build, "cpu_flags", lambda: None)  # no flags to read: plain C only
    assert [isa.name for isa in native_build.runnable_isas()] == ["scalar"]


# (cached prefix, new tokens) per request of one extend step: ragged chunks over ragged prefixes, a decode among them
EXTEND = [(0, 20), (37, 5), (100, 33), (50, 1), (15, 17)]


@pytest.mark.parametrize("kv_dtype", ["auto", "int4", "int8"])
@pytest.mark.parametrize("path", [*NATIVE, "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_extend_batch_matches_naive(path, dtype, page_size, group, head_dim, kv_dtype, monkeypatch):
    """Prefill chunks over cached prefixes (the compiled kernel: all in one call with the decodes,
    each query reading causally up to itself, pages in place) against naive causal attention over
    the K/V the pool holds (an int4 pool's dequantized, its rotated keys read back unrotated)."""
    native = use_path(path, monkeypatch)
    torch.manual_seed(group * head_dim + page_size)
    heads, scale = KV_HEADS * group, head_dim**-0.5
    kv_lens = [p + n for p, n in EXTEND]
    num_pages = sum(math.ceil(n / page_size) for n in kv_lens) + 4
    free = torch.randperm(num_pages).tolist()
    tables = [[free.pop() for _ in range(math.ceil(n / page_size))] for n in kv_lens]
    width = max(len(t) for t in tables)
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    cache = PagedKVCache(1, num_pages, page_size, KV_HEADS, head_dim, dtype, torch.device("cpu"), kv_dtype)
    backend = TorchBackend(cache, heads, head_dim, [LayerAttention(scale)], native=native)
    slots_of = lambda i, pos: page_table[i, pos // page_size] * page_size + pos % page_size  # noqa: E731
    for i, (prefix, _) in enumerate(EXTEND):
        if prefix:
            pos = torch.arange(prefix)
            cache.write(0, slots_of(i, pos), *(torch.randn(prefix, KV_HEADS, head_dim).to(dtype) for _ in range(2)))
    out_slots = torch.cat([slots_of(i, torch.arange(p, p + n)) for i, (p, n) in enumerate(EXTEND)])
    backend.init_forward(AttentionMetadata([n for _, n in EXTEND], kv_lens, page_table, out_slots, page_size))
    rows = sum(n for _, n in EXTEND)
    q = torch.randn(rows, heads, head_dim).to(dtype)
    k, v = (torch.randn(rows, KV_HEADS, head_dim).to(dtype) for _ in range(2))
    got = backend.forward(q, k, v, 0)
    tol = attention_tolerance(dtype, backend, kv_dtype)
    start = 0
    for i, (p, n) in enumerate(EXTEND):
        k_all, v_all = cache.read(0, slots_of(i, torch.arange(p + n)))
        want = naive_attention(q[start : start + n], k_all, v_all, scale)
        torch.testing.assert_close(got[start : start + n].double(), want, atol=tol, rtol=tol)
        start += n


def test_the_brgemm_variant_packs_for_tiles_exactly_where_the_cpu_has_amx():
    """torch's brgemm takes VNNI-packed B only on AMX tiles (elsewhere it raises): the variant packs
    where the CPU has amx_bf16 and hands torch's GEMM plain B everywhere else."""
    from radixrt.kernels.native_attention import build_variant
    from radixrt.kernels.native_build import ISA_BY_NAME, runnable_isas
    from support.kernels import AMX

    if "brgemm" not in [isa.name for isa in runnable_isas()]:
        pytest.skip("the brgemm variant needs AVX-512 with avx512_bf16; this CPU lacks them")
    require_native()
    assert build_variant(ISA_BY_NAME["brgemm"]).vnni == AMX


@pytest.mark.parametrize("path", NATIVE)
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_int4_scores_match_naive_attention_over_the_queries_the_variant_reads(path, page_size, group, head_dim, monkeypatch):
    """The kernel over an int4 pool, decodes and prefill chunks in one call, against float64 attention over
    the dequantized K/V and the queries as the variant reads them: a variant with VNNI quantizes them to int8
    per 32 for its integer dot products over the nibbles (support.kernels.int8_query_groups), the others
    read them as they are. To float32's tolerance, so a slip in the nibbles' order, a group's scale or the
    -8 offset shows."""
    from radixrt.kernels.kv_quant import dequantize_int4, quantize_int4
    from radixrt.kernels.native_attention import build_variant
    from radixrt.kernels.native_build import ISA_BY_NAME
    from support.kernels import int8_query_groups, variant_of

    use_path(path, monkeypatch)
    kernel = build_variant(ISA_BY_NAME[variant_of(path)])
    torch.manual_seed(group + head_dim + page_size)
    heads, scale = KV_HEADS * group, head_dim**-0.5
    kv_lens = [p + n for p, n in EXTEND]
    num_pages = sum(math.ceil(n / page_size) for n in kv_lens)
    pages = torch.randperm(num_pages)
    widths = [math.ceil(n / page_size) for n in kv_lens]
    table = torch.zeros(len(kv_lens), max(widths), dtype=torch.int64)
    for i, (at, w) in enumerate(zip([0, *torch.tensor(widths).cumsum(0).tolist()], widths)):
        table[i, :w] = pages[at : at + w]
    (k, ks), (v, vs) = (quantize_int4(torch.randn(num_pages * page_size, KV_HEADS, head_dim) * 2) for _ in range(2))
    pool = [x.view(num_pages, page_size, KV_HEADS, -1) for x in (k, v, ks, vs)]
    q_starts = torch.tensor([0, *torch.tensor([n for _, n in EXTEND]).cumsum(0).tolist()])
    q = torch.randn(int(q_starts[-1]), heads, head_dim)
    got, _ = kernel(q, pool[0], pool[1], table, torch.tensor(kv_lens), scale, q_starts=q_starts, scales=(pool[2], pool[3]))
    q_read = int8_query_groups(q) if kernel.int8_queries else q
    k_all, v_all = (dequantize_int4(x, sc, torch.float64) for x, sc in ((k, ks), (v, vs)))
    for i, (p, n) in enumerate(EXTEND):
        slots = (table[i, torch.arange(p + n) // page_size] * page_size + torch.arange(p + n) % page_size)
        want = naive_attention(q_read[q_starts[i] : q_starts[i + 1]], k_all[slots], v_all[slots], scale)
        torch.testing.assert_close(got[q_starts[i] : q_starts[i + 1]].double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("path", NATIVE)
@pytest.mark.parametrize("kv_heads,window,softcap", [(3, None, None), (1, None, 30.0), (3, 300, None), (2, None, None)])
def test_a_lone_decode_split_between_threads_equals_naive_attention(path, kv_heads, window, softcap, monkeypatch):
    """One request decoding over 700 tokens gives two threads 3 or 1 tasks (one per KV head): the kernel splits
    each task's tokens into parts and merges them by their log-sum-exps (2 KV heads: no split). Output and lse
    equal naive attention's over the same tokens, the window's and the soft cap's included."""
    from radixrt.kernels.native_attention import build_variant
    from radixrt.kernels.native_build import ISA_BY_NAME
    from support.kernels import variant_of

    require_native()
    kernel = build_variant(ISA_BY_NAME[variant_of(path)])
    group, D, T, scale = 3, 64, 700, 0.125
    g = torch.Generator().manual_seed(kv_heads)
    k, v = (torch.randn(T + 1, 1, kv_heads, D, generator=g).bfloat16() for _ in range(2))
    q = torch.randn(1, kv_heads * group, D, generator=g)
    pages = torch.randperm(T, generator=g).view(1, T)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out, lse = kernel(q, k, v, pages, torch.tensor([T]), scale, want_lse=True, window=window, softcap=softcap)
    finally:
        torch.set_num_threads(threads)
    k_seq, v_seq = k[pages[0], 0], v[pages[0], 0]
    want = naive_attention(q, k_seq, v_seq, scale, window, softcap)
    torch.testing.assert_close(out.double(), want, atol=2e-3, rtol=2e-3)
    s = torch.einsum("hd,thd->ht", q[0].double(), k_seq.double().repeat_interleave(group, 1)) * scale
    s = softcap * torch.tanh(s / softcap) if softcap else s
    torch.testing.assert_close(lse[0].double(), torch.logsumexp(s[:, -(window or T):], dim=1), atol=2e-3, rtol=1e-4)

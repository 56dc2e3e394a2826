"""The CPU decode paths against naive per-token attention in float64 over the K/V the pool
holds: the compiled kernel reading the pool in place (native_decode.py, csrc/decode_attention.c)
and the torch path (grouped float32 matmuls over a head-major gather, decode_attention.py).

One decode batch per case: ragged KV lengths (several length groups, padding inside each),
three requests sharing prefix pages (the cascade path), over every page size, GQA group,
head_dim, model dtype and pool format the issue names. The reference reads each request's
K/V back through PagedKVCache.read, so a quantized pool is compared with what it stores:
the tolerance is the attention's, not the quantizer's.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from radixrt.kernels import AttentionMetadata, LayerAttention, PagedKVCache
from radixrt.kernels import native_decode
from radixrt.kernels.decode_attention import attend, merge
from radixrt.kernels.torch_backend import TorchBackend

KV_HEADS = 2
SHARED = 80  # tokens of prefix pages shared by the first three requests (whole pages at 1 and 16)
# KV length of each request after this step; the first three extend the shared prefix
KV_LENS = [SHARED + 1, SHARED + 17, SHARED + 40, 1, 5, 16, 17, 33, 64, 100, 150]


def naive_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [heads, D]; k, v: [T, kv_heads, D] -> [heads, D], in float64, one query head at a time."""
    group = q.shape[0] // k.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(q.shape[0]):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        weights = torch.softmax(kh @ q[h].double() * scale, 0)
        out[h] = weights @ vh
    return out


def build_batch(page_size: int, seed: int) -> tuple[torch.Tensor, int]:
    """Page tables [reqs, max_pages] with scattered pages; the first three share SHARED tokens of pages."""
    num_pages = sum(math.ceil(n / page_size) for n in KV_LENS) + 8
    free = list(range(num_pages))
    random.Random(seed).shuffle(free)
    shared = [free.pop() for _ in range(SHARED // page_size)]
    tables = []
    for i, n in enumerate(KV_LENS):
        own_from = SHARED if i < 3 else 0
        tables.append((shared if i < 3 else []) + [free.pop() for _ in range(math.ceil((n - own_from) / page_size))])
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables]), num_pages


def require_native() -> None:
    """The compiled kernel must build wherever there is a C compiler; without one, say so and skip."""
    if native_decode.find_compiler() is None:
        pytest.skip("no C compiler on this machine: the compiled decode kernel cannot be built")
    native_decode.build()  # raises, failing the test, if the compiler cannot build it


# (path, pool format): the compiled kernel serves float32/bf16 pools; the torch path every format
PATHS = [("native", "auto"), ("torch", "auto"), ("torch", "int8"), ("torch", "fp8_e4m3")]


@pytest.mark.parametrize("path,kv_dtype", PATHS, ids=[f"{p}-{k}" for p, k in PATHS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_batch_matches_naive(path, kv_dtype, dtype, page_size, group, head_dim):
    if path == "native":
        require_native()
    torch.manual_seed(page_size + group + head_dim)
    heads, layers, scale = KV_HEADS * group, 2, head_dim**-0.5
    page_table, num_pages = build_batch(page_size, seed=group * head_dim)
    cache = PagedKVCache(layers, num_pages, page_size, KV_HEADS, head_dim, dtype, torch.device("cpu"), kv_dtype)
    backend = TorchBackend(cache, heads, head_dim, [LayerAttention(scale)] * layers, native=path == "native")
    slots_of = lambda i, pos: page_table[i, pos // page_size] * page_size + pos % page_size  # noqa: E731
    for layer in range(layers):  # history before this step (the shared prefix is written thrice: same values)
        shared_k, shared_v = torch.randn(SHARED, KV_HEADS, head_dim), torch.randn(SHARED, KV_HEADS, head_dim)
        for i, n in enumerate(KV_LENS):
            k, v = torch.randn(n - 1, KV_HEADS, head_dim), torch.randn(n - 1, KV_HEADS, head_dim)
            if i < 3:
                k[:SHARED], v[:SHARED] = shared_k, shared_v
            cache.write(layer, slots_of(i, torch.arange(n - 1)), k.to(dtype), v.to(dtype))
    out_slots = torch.cat([slots_of(i, torch.tensor([n - 1])) for i, n in enumerate(KV_LENS)])
    backend.init_forward(AttentionMetadata([1] * len(KV_LENS), KV_LENS, page_table, out_slots, page_size))
    assert [c.rows.tolist() for c in backend.layer_plans[0].cascades] == [[0, 1, 2]]
    assert not backend.layer_plans[0].prefills
    # the kernel reads each request's own length in one call; the torch path pads, in length groups
    assert len(backend.layer_plans[0].decodes) == 1 if path == "native" else len(backend.layer_plans[0].decodes) >= 3
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for layer in range(layers):
        q = torch.randn(len(KV_LENS), heads, head_dim).to(dtype)
        k, v = torch.randn(len(KV_LENS), KV_HEADS, head_dim).to(dtype), torch.randn(len(KV_LENS), KV_HEADS, head_dim).to(dtype)
        got = backend.forward(q, k, v, layer)
        assert got.dtype == dtype
        for i, n in enumerate(KV_LENS):
            k_all, v_all = cache.read(layer, slots_of(i, torch.arange(n)))  # what the pool holds, new token included
            want = naive_decode(q[i], k_all, v_all, scale)
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
    """int8 and fp8 pools dequantize through PagedKVCache.read; the kernel does not serve them."""
    for kv_dtype in ("int8", "fp8_e4m3"):
        cache = PagedKVCache(1, 4, 16, KV_HEADS, 64, torch.bfloat16, torch.device("cpu"), kv_dtype)
        assert TorchBackend(cache, 2 * KV_HEADS, 64, [LayerAttention(0.125)]).native is None
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
        "assert TorchBackend(cache, 4, 64, [LayerAttention(0.125)]).native is None\n"
    )
    env = {"PATH": "/usr/bin:/bin", "CC": str(tmp_path / "no-such-cc"), "XDG_CACHE_HOME": str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "compiled kernel is unavailable" in done.stderr and "using the torch path" in done.stderr

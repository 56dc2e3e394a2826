"""Attention over the pages a retention policy kept equals naive attention restricted to the same tokens.

A 200-token sequence of random K/V; the cache holds only what a policy kept, in scattered
page ids, written the way the runtime writes it: keys rotated at their sequence positions,
and for sink_window the sinks' keys re-rotated by the tokens dropped after them
(RotaryEmbedding.shift_keys). The reference is float64 softmax attention over exactly the
kept tokens, at StreamingLLM's in-cache positions for sink_window (sinks at 0.., the window
right after) and at the original positions for heavy_hitter. Both a decode and a prefill
chunk at the end; TorchBackend (compiled kernel and torch path) on the CPU and FlashInfer on
a CUDA GPU (skips without one).
"""

from __future__ import annotations

import pytest
import torch
from radixrt.kernels import AttentionMetadata, LayerAttention, PagedKVCache, create_attention_backend
from radixrt.kernels.torch_backend import TorchBackend
from radixrt.models.rope import RotaryEmbedding
from support.kernels import backend_device
from support.oracle import naive_attention

HEADS, KV_HEADS, D, PAGE, LENGTH = 4, 2, 64, 4, 200


def kept_tokens(policy: str) -> tuple[list[int], int]:
    """The kept token positions (in cache order) and the sinks among them."""
    if policy == "sink_window":
        return list(range(4)) + list(range(LENGTH - 48, LENGTH)), 4  # one page of sinks, 12 window pages
    heavy = [p * PAGE + i for p in (3, 9, 10, 30) for i in range(PAGE)]  # pages kept for their mass
    return heavy + list(range(LENGTH - 32, LENGTH)), 0


def rotated(rope: RotaryEmbedding, x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """x: [T, heads, D] -> rotated at `positions` (in float32)."""
    pos = torch.tensor(positions)
    return rope(pos, x, x)[1]


@pytest.mark.parametrize("n_new", [1, 8])
# torch-path: no compiled attention kernel
@pytest.mark.parametrize("backend", ["torch", "torch-path", pytest.param("flashinfer", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("policy", ["sink_window", "heavy_hitter"])
def test_attention_over_kept_pages_equals_naive_attention_over_the_kept_tokens(policy, backend, n_new):
    device, dtype, tol = backend_device(backend.removesuffix("-path"))
    torch.manual_seed(0)
    rope = RotaryEmbedding(D, 4096, 10000.0, {"rope_type": "default"}).to(device)
    q_raw = torch.randn(LENGTH, HEADS, D, device=device)
    k_raw, v = torch.randn(LENGTH, KV_HEADS, D, device=device), torch.randn(LENGTH, KV_HEADS, D, device=device)
    kept, sinks = kept_tokens(policy)
    dropped = kept[sinks] - sinks if sinks else 0  # sink_window: the tokens between the sinks and the window
    # what the pool holds: keys at their sequence positions, the sinks shifted by the dropped tokens
    k_pool = rotated(rope, k_raw[kept], kept)
    if sinks:
        k_pool[:sinks] = rope.shift_keys(k_pool[:sinks], dropped)
    # the reference's positions: in-cache for sink_window (StreamingLLM), original for heavy_hitter
    ref_pos = list(range(len(kept))) if sinks else kept
    k_ref = rotated(rope, k_raw[kept], ref_pos)
    q_new = kept[-n_new:]
    q_run = rotated(rope, q_raw[q_new], q_new).to(dtype)  # queries at their sequence positions, as the model runs them
    q_ref = rotated(rope, q_raw[q_new], ref_pos[-n_new:])

    pages = torch.randperm(40)[: len(kept) // PAGE].to(device)  # scattered, out of order
    cache = PagedKVCache(1, 40, PAGE, KV_HEADS, D, dtype, device)
    slots = (pages[:, None] * PAGE + torch.arange(PAGE, device=device)).reshape(-1)
    old = len(kept) - n_new
    cache.write(0, slots[:old], k_pool[:old].to(dtype), v[kept][:old].to(dtype))
    la = LayerAttention(scale=D**-0.5)
    if backend == "torch-path":
        attn = TorchBackend(cache, HEADS, D, [la], native=False)
    else:
        attn = create_attention_backend(backend, cache, HEADS, D, [la])
    attn.init_forward(AttentionMetadata([n_new], [len(kept)], pages[None], slots[old:], PAGE))
    out = attn.forward(q_run, k_pool[old:].to(dtype), v[kept][old:].to(dtype), 0)
    want = naive_attention(q_ref, k_ref, v[kept], la.scale)
    torch.testing.assert_close(out.double().cpu(), want.cpu(), atol=tol * 10, rtol=tol * 10)

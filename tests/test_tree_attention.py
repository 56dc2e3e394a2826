"""Draft-tree attention (AttentionMetadata.trees) against a naive attention over each row's own
branch: a draft sees the cached prefix and its ancestors only, at its depth's position.

Every path a tree can take: the compiled kernel's TreePlan (a decode of the prefix per row,
merged with the tree part), the torch path's masked prefill (no kernel, a sliding window, a
soft cap), and FlashInfer's custom mask on a GPU (skips, saying why, without one). The batch
mixes trees with decodes, a prefill chunk and a chain, so the planner's other paths run beside.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from radixrt.kernels import AttentionMetadata, LayerAttention, PagedKVCache
from radixrt.kernels.torch_backend import TorchBackend
from support.kernels import NATIVE, backend_device, use_path
from support.oracle import naive_attention

from radixrt.speculative.draft_tree import ancestry

# (cached prefix, new rows, the tree's parents or None: causal)
BATCH = [(9, 1, None), (23, 6, [-1, -1, 0, 0, 3]), (0, 5, None), (40, 4, [-1, 0, 1]), (17, 7, [-1, 0, -1, 2, 1, 4])]


def branch(parents: list[int] | None, r: int, n: int) -> list[int]:
    """The new rows row r reads, in order: itself and its ancestors (causal: rows 0 .. r)."""
    if parents is None:
        return list(range(r + 1))
    seen = ancestry(parents)[r]
    return [c for c in range(n) if seen[c]]


def run_batch(backend_of, page_size: int, layers: list[LayerAttention], device, dtype, tol, heads=8, kv_heads=2):
    torch.manual_seed(0)
    rng = random.Random(page_size)
    D, num_pages = 64, 256
    cache = PagedKVCache(len(layers), num_pages, page_size, kv_heads, D, dtype, device)
    backend = backend_of(cache, heads, D, layers)
    free = list(range(num_pages))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(math.ceil((p + n) / page_size))] for p, n, _ in BATCH]
    width = max(len(t) for t in tables)
    page_table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    slots_of = lambda i, pos: page_table[i, pos // page_size] * page_size + pos % page_size
    history = [[(torch.randn(p, kv_heads, D), torch.randn(p, kv_heads, D)) for _ in layers] for p, _, _ in BATCH]
    for layer in range(len(layers)):
        for i, (p, _, _) in enumerate(BATCH):
            hk, hv = history[i][layer]
            cache.write(layer, slots_of(i, torch.arange(p)).to(device), hk.to(device, dtype), hv.to(device, dtype))
    trees = {i: torch.tensor(ancestry(par), dtype=torch.bool, device=device) for i, (_, _, par) in enumerate(BATCH) if par}
    out_slots = torch.cat([slots_of(i, torch.arange(p, p + n)) for i, (p, n, _) in enumerate(BATCH)])
    meta = AttentionMetadata([n for _, n, _ in BATCH], [p + n for p, n, _ in BATCH], page_table.to(device),
                             out_slots.to(device), page_size, trees=trees)
    backend.init_forward(meta)
    T = sum(n for _, n, _ in BATCH)
    for layer, la in enumerate(layers):
        q, k, v = (torch.randn(T, h, D).to(dtype).float() for h in (heads, kv_heads, kv_heads))
        got = backend.forward(q.to(device, dtype), k.to(device, dtype), v.to(device, dtype), layer).float().cpu()
        row = 0
        for i, (p, n, parents) in enumerate(BATCH):
            hk, hv = (x.to(dtype).float() for x in history[i][layer])
            for r in range(n):
                seen = [row + c for c in branch(parents, r, n)]
                want = naive_attention(q[row + r], torch.cat([hk, k[seen]]), torch.cat([hv, v[seen]]), la.scale,
                                       la.window, la.softcap).float()
                torch.testing.assert_close(got[row + r], want, atol=tol, rtol=tol, msg=f"request {i} row {r}")
            row += n


@pytest.mark.parametrize("path", [*NATIVE, "torch"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_tree_rows_read_their_branch(path, page_size, monkeypatch):
    native = use_path(path, monkeypatch)
    layers = [LayerAttention(64**-0.5), LayerAttention(64**-0.5, softcap=30.0)]
    run_batch(lambda c, h, d, ls: TorchBackend(c, h, d, ls, native=native), page_size, layers,
              torch.device("cpu"), torch.float32, 1e-5)


@pytest.mark.parametrize("path", [*NATIVE, "torch"])
def test_windowed_tree_rows_window_by_depth(path, monkeypatch):
    """A window cuts the prefix by each draft's position (the root's plus its depth), not its row."""
    native = use_path(path, monkeypatch)
    layers = [LayerAttention(64**-0.5, window=12), LayerAttention(64**-0.5, window=3), LayerAttention(64**-0.5)]
    run_batch(lambda c, h, d, ls: TorchBackend(c, h, d, ls, native=native), 4, layers,
              torch.device("cpu"), torch.float32, 1e-5)


def test_bf16_pool_tree_through_the_kernel(monkeypatch):
    use_path(NATIVE[0], monkeypatch)
    run_batch(lambda c, h, d, ls: TorchBackend(c, h, d, ls, native=True), 16, [LayerAttention(64**-0.5)],
              torch.device("cpu"), torch.bfloat16, 2e-2)


@pytest.mark.cuda
def test_flashinfer_custom_mask_reads_the_branch():
    from radixrt.kernels.flashinfer_backend import FlashInferBackend

    device, dtype, tol = backend_device("flashinfer")
    run_batch(FlashInferBackend, 16, [LayerAttention(64**-0.5)], device, dtype, tol)

"""GPU only (scripts/gpu_check.sh runs it): how to attend an extend (new tokens over a cached
prefix) with FlashInfer, measured both ways on the same pages.

  paged:  one causal pass of the paged prefill kernel over prefix + new pages (bottom-right
          causal), the new K/V written into the pool first. What FlashInferBackend does.
  ragged: a causal ragged pass over the new tokens' own K/V, a non-causal paged pass over
          the prefix pages alone, both returning log-sum-exp, merged with merge_state.

Prints the time of each (plan excluded: it is once per step for every layer), their ratio,
and the largest difference between the two outputs, for a few batch shapes. Writes
bench/results/flashinfer_extend.json.

    python bench/flashinfer_extend.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder only (gpu_check.sh runs python -P)

from common import write_result  # noqa: E402

# (requests, prefix tokens each, new tokens each)
SHAPES = [(1, 4096, 512), (8, 2048, 256), (32, 512, 128), (64, 1024, 16), (4, 8192, 2048)]
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16  # a Llama-3-8B layer


def indptr(lengths, torch, dev):
    t = torch.tensor([0, *lengths], dtype=torch.int32, device=dev)
    return torch.cumsum(t, 0, dtype=torch.int32)


def time_ms(fn, torch, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def one_shape(b: int, prefix: int, new: int, flashinfer, torch) -> dict:
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)
    pre_pages, all_pages = -(-prefix // PAGE), -(-(prefix + new) // PAGE)
    pool_pages = b * all_pages + 1
    k_pool = torch.randn(pool_pages, PAGE, KV_HEADS, HEAD_DIM, dtype=dt, device=dev, generator=gen)
    v_pool = torch.randn(pool_pages, PAGE, KV_HEADS, HEAD_DIM, dtype=dt, device=dev, generator=gen)
    order = torch.randperm(pool_pages - 1, device=dev, generator=gen)[: b * all_pages].to(torch.int32)
    table = order.view(b, all_pages)  # [b, all_pages] each request's pages, scattered
    q = torch.randn(b * new, HEADS, HEAD_DIM, dtype=dt, device=dev, generator=gen)
    # the new tokens' K/V, as the layer produced them (and as written into the pool)
    pos = torch.arange(prefix, prefix + new, device=dev)
    slots = (table[:, pos // PAGE].long() * PAGE + pos % PAGE).reshape(-1)  # [b * new]
    k_new = k_pool.view(-1, KV_HEADS, HEAD_DIM)[slots].clone()
    v_new = v_pool.view(-1, KV_HEADS, HEAD_DIM)[slots].clone()
    ws = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    common = dict(q_data_type=dt, kv_data_type=dt, sm_scale=HEAD_DIM**-0.5)
    qo = indptr([new] * b, torch, dev)

    def last_len(n):
        return torch.full((b,), n - (-(-n // PAGE) - 1) * PAGE, dtype=torch.int32, device=dev)

    paged = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    paged.plan(qo, indptr([all_pages] * b, torch, dev), table.reshape(-1), last_len(prefix + new),
               HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=True, **common)
    ws2 = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    ragged = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws2, "NHD")
    ragged.plan(qo, qo, HEADS, KV_HEADS, HEAD_DIM, causal=True, **common)
    ws3 = torch.zeros(256 << 20, dtype=torch.uint8, device=dev)
    prefix_pass = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws3, "NHD")
    prefix_pass.plan(qo, indptr([pre_pages] * b, torch, dev), table[:, :pre_pages].reshape(-1), last_len(prefix),
                     HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=False, **common)

    def run_paged():
        return paged.run(q, (k_pool, v_pool))

    def run_ragged():
        o1, s1 = ragged.run(q, k_new, v_new, return_lse=True)
        o2, s2 = prefix_pass.run(q, (k_pool, v_pool), return_lse=True)
        return flashinfer.merge_state(o1, s1, o2, s2)[0]

    diff = (run_paged().float() - run_ragged().float()).abs().max().item()
    t_paged, t_ragged = time_ms(run_paged, torch), time_ms(run_ragged, torch)
    return {"requests": b, "prefix": prefix, "new": new, "paged_ms": t_paged, "ragged_ms": t_ragged,
            "ragged_over_paged": t_ragged / t_paged, "max_abs_diff": diff}


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    import torch

    if not torch.cuda.is_available():
        print("flashinfer_extend: needs a CUDA GPU; none is present")
        return 1
    import flashinfer

    rows = [one_shape(b, p, n, flashinfer, torch) for b, p, n in SHAPES]
    print(f"{'reqs':>5} {'prefix':>7} {'new':>5} {'paged ms':>9} {'ragged+merge ms':>16} {'ragged/paged':>13} {'max diff':>9}")
    for r in rows:
        print(f"{r['requests']:>5} {r['prefix']:>7} {r['new']:>5} {r['paged_ms']:>9.3f} {r['ragged_ms']:>16.3f} "
              f"{r['ragged_over_paged']:>12.2f}x {r['max_abs_diff']:>9.4f}")
    write_result("flashinfer_extend", {"gpu": torch.cuda.get_device_name(), "flashinfer": flashinfer.__version__,
                                       "layer": [HEADS, KV_HEADS, HEAD_DIM, PAGE], "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())

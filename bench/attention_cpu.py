"""CPU decode attention candidates over the paged KV pool, per layer, in one run.

One query token per request over a pool of scattered pages, as a decode step sees it.
Candidates (each returns [B, heads, head_dim]):
  sdpa        the old path: the padded gather by advanced indexing (pool[slots]) in the
              model's dtype, then scaled_dot_product_attention with a mask (the baseline)
  sdpa_f32    gather by index_select into head-major float32, then scaled_dot_product_attention
  grouped     the torch path: the same gather (PagedKVCache.read_heads), then two grouped
              float32 matmuls and a softmax (kernels/decode_attention.py)
  pages       whole pages gathered by page id (index_select over [pages, page_size, ...]),
              padding masked, then grouped: the closest torch ops come to reading pages in place
  native      the compiled kernel (kernels/csrc/decode_attention.c) reading the pool in place,
              row by row from each request's pages, no gathered copy: what TorchBackend runs
              where it builds (the torch path, `grouped`, where it does not)
Sweeps one axis at a time around a base point (batch 64, 600 KV tokens, head_dim 64, GQA
group 3 with 4 KV heads, page size 16, bf16), plus batch x KV length for both dtypes.
Runs under the allocator a CPU worker starts with (radixrt/server/worker_env.py).
Prints ms per candidate and the speedups of `native` and `grouped` over `sdpa`; writes
bench/results/attention_cpu.json and .png.

    .venv/bin/python bench/attention_cpu.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from common import RESULTS, write_result
from radixrt.kernels import AttentionMetadata, LayerAttention, PagedKVCache
from radixrt.kernels.torch_backend import TorchBackend
from radixrt.server.worker_env import find_tcmalloc, worker_env
from radixrt.kernels.decode_attention import attend, group_queries
from radixrt.kernels.native_decode import load_native_decode

KV_HEADS = 4
MAX_GATHERED = 64 * 4096  # batch x KV tokens per case: bounds memory and time


@dataclass(frozen=True)
class Case:
    batch: int = 64
    kv_len: int = 600
    head_dim: int = 64
    group: int = 3
    page_size: int = 16
    dtype: str = "bfloat16"


class Setup:
    """A pool holding every request's KV on shuffled pages, and the backend planned for one decode step."""

    def __init__(self, c: Case) -> None:
        g = torch.Generator().manual_seed(0)
        dtype = getattr(torch, c.dtype)
        self.c, self.heads = c, KV_HEADS * c.group
        self.pages_per_req = math.ceil(c.kv_len / c.page_size)
        num_pages = c.batch * self.pages_per_req
        self.cache = PagedKVCache(1, num_pages, c.page_size, KV_HEADS, c.head_dim, dtype, torch.device("cpu"))
        for buf in (self.cache.k[0], self.cache.v[0]):
            buf[:num_pages] = torch.randn(buf[:num_pages].shape, generator=g).to(dtype)
        self.page_table = torch.randperm(num_pages, generator=g).view(c.batch, self.pages_per_req)
        self.q = torch.randn(c.batch, self.heads, c.head_dim, generator=g).to(dtype)
        self.backend = TorchBackend(self.cache, self.heads, c.head_dim, [LayerAttention(c.head_dim**-0.5)], native=False)
        out_slots = self.page_table[:, (c.kv_len - 1) // c.page_size] * c.page_size + (c.kv_len - 1) % c.page_size
        self.backend.init_forward(AttentionMetadata([1] * c.batch, [c.kv_len] * c.batch, self.page_table, out_slots, c.page_size))
        (self.plan,) = self.backend.layer_plans[0].decodes  # one length: one group
        self.scale = c.head_dim**-0.5
        self.kernel = load_native_decode()
        assert self.kernel is not None, "the compiled kernel did not build (see the log)"

    def sdpa(self) -> torch.Tensor:
        flat_k, flat_v = (b.view(-1, KV_HEADS, self.c.head_dim) for b in (self.cache.k[0], self.cache.v[0]))
        k, v = flat_k[self.plan.run.slots], flat_v[self.plan.run.slots]  # [B, T, kv_heads, D], model dtype
        mask = self.plan.run.bias == 0  # [B, 1, 1, T]
        o = F.scaled_dot_product_attention(self.q[:, :, None], k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=mask, scale=self.scale, enable_gqa=True)
        return o[:, :, 0]

    def sdpa_f32(self) -> torch.Tensor:
        k, v = self.cache.read_heads(0, self.plan.run.slots)
        o = F.scaled_dot_product_attention(self.q[:, :, None].float(), k, v, attn_mask=self.plan.run.bias,
                                           scale=self.scale, enable_gqa=True)
        return o[:, :, 0].to(self.q.dtype)

    def grouped(self) -> torch.Tensor:
        k, v = self.cache.read_heads(0, self.plan.run.slots)
        o, _ = attend(group_queries(self.q, KV_HEADS), k, v, self.plan.run.bias, self.scale)
        return o.reshape(self.q.shape).to(self.q.dtype)

    def native(self) -> torch.Tensor:
        run = self.plan.run
        out, _ = self.kernel(self.q.float(), self.cache.k[0], self.cache.v[0], run.pages, run.lens, self.scale)
        return out.to(self.q.dtype)

    def pages(self) -> torch.Tensor:
        c, B = self.c, self.c.batch
        T = self.pages_per_req * c.page_size
        heads = []
        for buf in (self.cache.k[0], self.cache.v[0]):
            raw = buf.index_select(0, self.page_table.reshape(-1)).view(B, T, KV_HEADS, c.head_dim)
            heads.append(torch.empty(B, KV_HEADS, T, c.head_dim).copy_(raw.transpose(1, 2)))
        k, v = heads
        valid = torch.arange(T) < c.kv_len
        v[:, :, ~valid] = 0  # the last page's unwritten slots may hold anything
        bias = torch.zeros(T).masked_fill_(~valid, float("-inf"))
        o, _ = attend(group_queries(self.q, KV_HEADS), k, v, bias, self.scale)
        return o.reshape(self.q.shape).to(self.q.dtype)


CANDIDATES = ("sdpa", "sdpa_f32", "grouped", "pages", "native")


def best_ms(fn, budget_s: float) -> float:
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < 3 or (time.perf_counter() - start < budget_s and len(times) < 20):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def run_case(c: Case, budget_s: float) -> dict:
    s = Setup(c)
    ref = s.native().float()
    row = {"case": c.__dict__}
    for name in CANDIDATES:
        fn = getattr(s, name)
        err = (fn().float() - ref).abs().max().item()
        assert err < 5e-2, f"{name} disagrees with native by {err} at {c}"
        row[name] = best_ms(fn, budget_s)
    row["speedup"] = row["sdpa"] / row["native"]
    row["speedup_torch_path"] = row["sdpa"] / row["grouped"]
    print(f"{c.dtype:8} B={c.batch:3} kv={c.kv_len:4} D={c.head_dim:3} g={c.group} ps={c.page_size:2}  "
          + "  ".join(f"{n} {row[n]:7.2f}" for n in CANDIDATES) + f"  sdpa/native {row['speedup']:5.2f}x  sdpa/grouped {row['speedup_torch_path']:5.2f}x", flush=True)
    return row


def cases(quick: bool) -> list[tuple[str, Case]]:
    base = Case()
    axes = {
        "dtype": [replace(base, dtype=d) for d in ("float32", "bfloat16")],
        "batch": [replace(base, batch=b) for b in (1, 16, 64, 256)],
        "kv_len": [replace(base, kv_len=n) for n in (64, 600, 1024, 4096)],
        "head_dim": [replace(base, head_dim=d) for d in (64, 128)],
        "group": [replace(base, group=g) for g in (1, 3, 8)],
        "page_size": [replace(base, page_size=p) for p in (1, 16)],
    }
    if not quick:
        axes["batch_x_kv"] = [
            replace(base, batch=b, kv_len=n, dtype=d)
            for d in ("float32", "bfloat16") for b in (1, 16, 256) for n in (64, 1024, 4096)
        ]
    out = [(axis, c) for axis, cs in axes.items() for c in cs if c.batch * c.kv_len <= MAX_GATHERED]
    return out


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = [a for a in dict.fromkeys(r["axis"] for r in rows) if a != "batch_x_kv"]
    fig, subplots = plt.subplots(1, len(axes), figsize=(3.2 * len(axes), 3.4))
    for ax, axis in zip(subplots, axes):
        sel = [r for r in rows if r["axis"] == axis]
        labels = [str(r["case"][axis]) for r in sel]
        for name in CANDIDATES:
            ax.plot(labels, [r[name] for r in sel], marker="o", label=name)
        ax.set_title(axis)
        ax.set_yscale("log")
        ax.set_xlabel(axis)
    subplots[0].set_ylabel("ms per layer (log)")
    subplots[-1].legend(fontsize=7)
    fig.suptitle("CPU decode attention, one layer (base: B=64, kv=600, D=64, group 3, page 16, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if "RADIXRT_WORKER_ENV" not in os.environ:  # measure under the allocator a worker starts with
        env = worker_env(tcmalloc=find_tcmalloc()) | {"RADIXRT_WORKER_ENV": "1"}
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the one-axis sweeps only")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=0.5, help="timing budget per candidate and case")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    rows = []
    for axis, c in cases(a.quick):
        rows.append(dict(run_case(c, a.budget_s), axis=axis))
    for key, what in (("speedup", "native"), ("speedup_torch_path", "grouped (torch path)")):
        x = sorted(r[key] for r in rows)
        print(f"{what} over sdpa: min {x[0]:.2f}x, median {x[len(x) // 2]:.2f}x, max {x[-1]:.2f}x over {len(rows)} cases")
    print("fastest candidate per case: " + ", ".join(f"{n} {sum(min(CANDIDATES, key=r.get) == n for r in rows)}" for n in CANDIDATES))
    print("wrote", write_result("attention_cpu", {"threads": torch.get_num_threads(), "rows": rows}))
    plot(rows, RESULTS / "attention_cpu.png")
    print("wrote", RESULTS / "attention_cpu.png")


if __name__ == "__main__":
    main()

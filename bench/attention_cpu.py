"""CPU decode attention candidates over the paged KV pool, per layer, in one run.

One query token per request over a pool of scattered pages, as a decode step sees it.
Candidates (each returns [B, heads, head_dim]):
  sdpa        the old path: the padded gather by advanced indexing (pool[slots]) in the
              model's dtype, then scaled_dot_product_attention with a mask (the baseline)
  sdpa_f32    gather by index_select into head-major float32, then scaled_dot_product_attention
  grouped     the torch path: the same gather (PagedKVCache.read_heads), then two grouped
              float32 matmuls and a softmax (radixrt/kernels/decode_attention.py)
  pages       whole pages gathered by page id (index_select over [pages, page_size, ...]),
              padding masked, then grouped: the closest torch ops come to reading pages in place
  native-ISA  the compiled kernel (radixrt/kernels/csrc/paged_attention.c) reading the pool in place,
              row by row from each request's pages, no gathered copy, once per variant this
              CPU runs (native-avx512, native-avx2, native-scalar; radixrt/kernels/native_build.py).
              TorchBackend runs the one its start-up measurement picks for decodes (`chosen`,
              radixrt/kernels/kernel_choice.py) where it builds, the torch path (`grouped`) where
              it does not; each variant's time over the chosen one's is printed beside it
Then the many-row classes (prefill chunks over a cached prefix, a cascade's shared prefix: the
start-up probe's calls, kernel_choice.Probe) per variant over six shapes, where the brgemm
variant's tile products (AMX tiles on a CPU with amx_bf16) compete; each variant's time over
the one kernel_choice picks for that class is printed.
Sweeps one axis at a time around a base point (batch 64, 600 KV tokens, head_dim 64, GQA
group 3 with 4 KV heads, page size 16, bf16), plus batch x KV length for both dtypes.
Runs under the allocator a CPU worker starts with (radixrt/launch/worker_env.py).
Candidates are timed in turn, round after round, and each reports its median (a load that
comes and goes slows them alike). Prints ms per candidate, each native variant's GB/s (the
K + V bytes one layer reads / its time) and that as a share of this host's copy bandwidth
(peaks.copy_gbps; goal: >= 50%), and the speedups of `chosen` and `grouped` over `sdpa`;
writes bench/results/attention_cpu.json (with peaks.host()) and .png.

    .venv/bin/python bench/attention_cpu.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import functools
import math
import random
import statistics
import time
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from common import RESULTS, write_result
from peaks import copy_gbps, host, run_as_worker
from radixrt.kernels import AttentionMetadata, LayerAttention, PagedKVCache
from radixrt.kernels.decode_attention import attend, group_queries
from radixrt.kernels.kernel_choice import Probe, Shape, choose_kernels
from radixrt.kernels.native_build import runnable_isas
from radixrt.kernels.native_attention import NativeAttention, build_variant
from radixrt.kernels.torch_backend import TorchBackend

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
        # every variant this CPU runs whose vectors divide head_dim, best first; raises if one cannot build
        self.kernels = {f"native-{isa.name}": build_variant(isa) for isa in runnable_isas() if c.head_dim % isa.lanes == 0}
        # the one TorchBackend runs for decodes: measured at start (kernel_choice.py), or forced
        shape = Shape(self.heads, KV_HEADS, c.head_dim, c.page_size, dtype)
        self.chosen = f"native-{choose_kernels(shape).decode.isa.name}"
        # K and V of every request, as one layer's decode reads them
        self.kv_bytes = 2 * c.batch * c.kv_len * KV_HEADS * c.head_dim * self.cache.k[0].element_size()

    def candidates(self) -> dict:
        """name -> a call returning [B, heads, head_dim] in the model's dtype."""
        torch_paths = {name: getattr(self, name) for name in TORCH_CANDIDATES}
        return torch_paths | {name: functools.partial(self.native, k) for name, k in self.kernels.items()}

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

    def native(self, kernel: NativeAttention) -> torch.Tensor:
        run = self.plan.run
        out, _ = kernel(self.q.float(), self.cache.k[0], self.cache.v[0], run.pages, run.lens, self.scale)
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


TORCH_CANDIDATES = ("sdpa", "sdpa_f32", "grouped", "pages")


def median_ms(fns: dict, budget_s: float) -> dict[str, float]:
    """name -> median ms of fns[name](), the candidates timed in turn, round after round: at least
    3 rounds, then until budget_s per candidate is spent (20 at most). Call each once before. Each
    round times them in a new (seeded) order: a candidate timed right after another that read the
    same pool finds it in the last-level cache, so a fixed order favoured the second of two kernel
    variants (on a Xeon with a large L3 all 12 cases ranked avx512bf16, always timed right after a
    torch candidate, behind avx512, timed after it, running the very same code)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names, order = list(fns), random.Random(0)
    start = time.perf_counter()
    for r in range(20):
        if r >= 3 and time.perf_counter() - start > budget_s * len(fns):
            break
        order.shuffle(names)
        for name in names:
            fn = fns[name]
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def run_case(c: Case, budget_s: float, copy: float) -> dict:
    s = Setup(c)
    fns = s.candidates()
    ref = fns[s.chosen]().float()
    for name, fn in fns.items():  # also each candidate's untimed first call: allocation, kernel selection
        err = (fn().float() - ref).abs().max().item()
        assert err < 5e-2, f"{name} disagrees with {s.chosen} by {err} at {c}"
    row = {"case": c.__dict__, "chosen": s.chosen, **median_ms(fns, budget_s)}
    row["gbps"] = {name: s.kv_bytes / row[name] / 1e6 for name in fns}  # bytes / ms / 1e6 = GB/s
    row["copy_share"] = {name: gbps / copy for name, gbps in row["gbps"].items()}
    row["speedup"] = row["sdpa"] / row[s.chosen]
    row["speedup_torch_path"] = row["sdpa"] / row["grouped"]
    row["over_chosen"] = {n: row[n] / row[s.chosen] for n in s.kernels}  # each variant's time over the chosen one's
    natives = "  ".join(f"{n} {row[n]:6.3f} ({row['gbps'][n]:5.1f} GB/s {100 * row['copy_share'][n]:3.0f}%, "
                        f"{row['over_chosen'][n]:.2f}x)" for n in s.kernels)
    print(f"{c.dtype:8} B={c.batch:3} kv={c.kv_len:4} D={c.head_dim:3} g={c.group} ps={c.page_size:2}  "
          + "  ".join(f"{n} {row[n]:7.2f}" for n in TORCH_CANDIDATES) + f"  {natives}"
          + f"  sdpa/chosen {row['speedup']:5.2f}x  sdpa/grouped {row['speedup_torch_path']:5.2f}x", flush=True)  # fmt: skip
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


# (heads, KV heads, head_dim, page size) of the many-row sweep: GQA groups 1/3/8, head_dim 64/128, pages 1/16
MANY_ROW_SHAPES = [(4, 4, 64, 16), (12, 4, 64, 16), (9, 3, 64, 1), (32, 8, 128, 16), (16, 2, 128, 16), (8, 8, 128, 1)]


def many_row_rows(budget_s: float) -> list[dict]:
    """Each variant's median ms on the extend and cascade probes, and its time over the chosen one's."""
    rows = []
    for heads, kv_heads, head_dim, page_size in MANY_ROW_SHAPES:
        shape = Shape(heads, kv_heads, head_dim, page_size, torch.bfloat16)
        probe, choice = Probe(shape), choose_kernels(shape)
        kernels = {isa.name: build_variant(isa) for isa in runnable_isas() if head_dim % isa.lanes == 0 and isa.name != "scalar"}
        for cls in ("extend", "cascade"):
            fns = {n: functools.partial(probe.run, k, cls) for n, k in kernels.items()}
            for fn in fns.values():
                fn()
            ms = median_ms(fns, budget_s)
            chosen = getattr(choice, cls).isa.name
            over = {n: t / ms[chosen] for n, t in ms.items()}
            rows.append({"shape": shape.__dict__ | {"dtype": "bfloat16"}, "class": cls, "chosen": chosen, "ms": ms, "over_chosen": over})
            print(f"{cls:7} heads {heads:2}/{kv_heads} D={head_dim:3} ps={page_size:2}  chosen {chosen:10} "
                  + "  ".join(f"{n} {ms[n]:6.3f} ({over[n]:.2f}x)" for n in ms), flush=True)
    return rows


def plot(rows: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axes = [a for a in dict.fromkeys(r["axis"] for r in rows) if a != "batch_x_kv"]
    fig, subplots = plt.subplots(1, len(axes), figsize=(3.2 * len(axes), 3.4))
    for ax, axis in zip(subplots, axes):
        sel = [r for r in rows if r["axis"] == axis]
        labels = [str(r["case"][axis]) for r in sel]
        for name in sel[0]["gbps"]:  # every candidate, native variants included
            ax.plot(labels, [r[name] for r in sel], marker="o", label=name)
        ax.set_title(axis)
        ax.set_yscale("log")
        ax.set_xlabel(axis)
    subplots[0].set_ylabel("ms per layer (log)")
    subplots[-1].legend(fontsize=7)
    fig.suptitle("CPU decode attention, one layer (base: B=64, kv=600, D=64, group 3, page 16, bf16)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def summarize(measured: list[dict]) -> None:
    """Print the spread of the speedups and bandwidth shares over the distinct cases measured."""
    def spread(x: list[float], fmt: str) -> str:
        x = sorted(x)
        return f"min {fmt.format(x[0])}, median {fmt.format(x[len(x) // 2])}, max {fmt.format(x[-1])}"

    for key, what in (("speedup", "chosen native"), ("speedup_torch_path", "grouped (torch path)")):
        print(f"{what} over sdpa: {spread([r[key] for r in measured], '{:.2f}x')} over {len(measured)} cases")
    names = list(dict.fromkeys(n for r in measured for n in r["gbps"]))
    for n in (n for n in names if n.startswith("native-")):
        shares = [100 * r["copy_share"][n] for r in measured if n in r["copy_share"]]
        print(f"{n} share of the copy bandwidth: {spread(shares, '{:.0f}%')}")
    fastest = [min(r["gbps"], key=r.get) for r in measured]
    print("fastest candidate per case: " + ", ".join(f"{n} {fastest.count(n)}" for n in names))
    for n in (n for n in names if n.startswith("native-")):
        print(f"{n} time over the chosen variant's: {spread([r['over_chosen'][n] for r in measured], '{:.2f}x')}")


def main() -> None:
    run_as_worker()  # measure under the allocator a worker starts with
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the one-axis sweeps only, on a smaller budget")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--budget-s", type=float, default=None, help="timing budget per candidate and case (0.5 s; --quick 0.1 s)")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    budget = a.budget_s if a.budget_s is not None else 0.1 if a.quick else 0.5
    copy = copy_gbps()
    print(host(), f"copy {copy:.1f} GB/s (read + write); native: ms (GB/s of K + V read, share of copy)", flush=True)
    rows, seen = [], {}
    for axis, c in cases(a.quick):  # the base point is on every axis: measured once
        seen[c] = seen.get(c) or run_case(c, budget, copy)
        rows.append(dict(seen[c], axis=axis))
    summarize(list(seen.values()))
    print("many-row classes (bf16 pools): ms per call, each variant's time over the chosen one's", flush=True)
    many = many_row_rows(budget)
    result = {"threads": torch.get_num_threads(), "host": host(), "copy_gbps": copy, "rows": rows, "many_rows": many}
    print("wrote", write_result("attention_cpu", result))
    plot(rows, RESULTS / "attention_cpu.png")
    print("wrote", RESULTS / "attention_cpu.png")


if __name__ == "__main__":
    main()

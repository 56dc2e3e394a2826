"""Where one decode step's time goes: against this host's roofs (default), or sampled from a server (--py-spy).

Roofline (the default). Each model is built in this process as a CPU worker builds it
(load_model, its linear weights held in the dtype choose_matmul_dtype picks, torch's
threads as the worker sets them, under the worker's allocator), beside a PagedKVCache and
a TorchBackend. Each batch (--batches) is one decode step of that many requests, each with
--kv-len tokens of KV on shuffled pages (page size 16, bf16): the plan, the forward and the
logits, no sampling. Plain and instrumented steps (attention and linear layers clocked)
alternate until --budget-s is spent; the figures are medians, each part's over the
instrumented steps (model and other: differences within one step). Per (model, batch):
  step         a plain step, ms
  attention    TorchBackend.forward, all layers (KV write and decode kernel), ms; its GB/s
               (K + V bytes the step reads / time) and that as a share of copy_gbps()
               (goal: >= 50%)
  linear       the model's linear layers and LM head as they run in it, ms
  gemm-only    the same GEMMs alone: for each layer, F.linear at its exact shape and weight
               dtype, timed by peaks.gemm_seconds (cold weights); the model's GFLOP/s is
               their FLOPs over the model part, the probes' the same over gemm-only
  model        the model part, step - attention, and that as a multiple of gemm-only (goal: <= 1.5x)
  other        step - attention - linear: norms, rope, embedding, residuals, the plan
The GEMM probes run after the steps, not interleaved with them: on a loaded machine compare
x gemm across runs with care.
Writes bench/results/step_profile.json: "roofline"["MODEL/TAG"], with host() and the peaks.

    .venv/bin/python bench/step_profile.py [--models small,smollm2] [--batches 1,16,64] [--tag after]

py-spy (--py-spy). 64 requests with short prompts decode 192 tokens each through an Engine
(greedy, ignore_eos), so nearly every step is a batch-64 decode. py-spy samples both
processes while they run; each sample is put in the first bucket whose function appears in
its stack:
  attention plan   TorchBackend.init_forward (page tables -> kernel arguments)
  attention        TorchBackend.forward (KV write, decode kernel)
  model            the rest of the forward: matmuls, norms, rope, logits
  batch prep       ModelRunner._prepare / _apply_slot_changes (per-step tensors)
  sampling         ModelRunner._sample (and logprobs)
  ipc              zmq and msgspec in the worker (Receiver.recv is idle time: not counted)
  scheduler        every active sample of the scheduler process
"Overhead" is everything but model and attention, as a share of the worker's busy time
plus the scheduler's (the two run one after the other on this 2-core machine). Needs py-spy
(`pip install py-spy`); writes "runs"["MODEL/TAG"] of the same file.

    .venv/bin/python bench/step_profile.py --py-spy [--models tiny] [--tag after]

Models: tiny, small, smollm2 (the peers' checkpoints) or a checkpoint directory.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from common import RESULTS, write_result
from peaks import copy_gbps, gemm_seconds, host, run_as_worker
from radixrt.kernels import AttentionMetadata, PagedKVCache
from radixrt.kernels.torch_backend import TorchBackend

from radixrt.models import ModelConfig, load_model
from radixrt.models.cpu_matmul import choose_matmul_dtype, hold_linear_weights_in
from radixrt.models.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup

PEER_MODELS = Path.home() / ".cache" / "radixrt-peers" / "models"
PAGE_SIZE, DTYPE = 16, torch.bfloat16
ATTENTION_GOAL, MODEL_GOAL = 0.5, 1.5  # share of the copy bandwidth; multiple of gemm-only
BATCH, PROMPT, NEW = 64, 32, 192  # the py-spy run
# (bucket, function names that put a sample in it), checked in order
WORKER_BUCKETS = [
    ("attention plan", ("TorchBackend.init_forward",)),
    ("attention", ("TorchBackend.forward",)),
    ("model", ("LlamaForCausalLM.forward", "LlamaForCausalLM.compute_logits")),
    ("batch prep", ("ModelRunner._prepare", "ModelRunner._apply_slot_changes")),
    ("sampling", ("ModelRunner._sample", "entry_logprobs")),
    ("ipc", ("Sender.send", "Receiver.recv")),
]


def model_dir(name: str) -> str:
    return str(PEER_MODELS / name) if (PEER_MODELS / name).is_dir() else name


def store(section: str, key: str, value: dict) -> None:
    """Put value at [section][key] of step_profile.json, keeping every other entry of both sections."""
    path = RESULTS / "step_profile.json"
    data = json.loads(path.read_text()) if path.exists() else {}
    data.setdefault(section, {})[key] = value
    print("wrote", write_result("step_profile", {k: data.get(k, {}) for k in ("runs", "roofline")}))


# ---------------------------------------------------------------- roofline


class DecodeStep:
    """One decode step of `batch` requests, each with kv_len tokens of KV on shuffled pages."""

    def __init__(self, model: torch.nn.Module, cfg: ModelConfig, batch: int, kv_len: int) -> None:
        g = torch.Generator().manual_seed(0)
        pages_per_req = math.ceil(kv_len / PAGE_SIZE)
        num_pages = batch * pages_per_req
        self.cache = PagedKVCache(cfg.num_layers, num_pages, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim, DTYPE, torch.device("cpu"))
        for buf in self.cache.k + self.cache.v:
            buf[:num_pages].normal_(generator=g)  # [pages, page_size, kv_heads, head_dim]; the pad page stays zero
        self.attn = TorchBackend(self.cache, cfg.num_heads, cfg.head_dim, cfg.attention_layers())
        page_table = torch.randperm(num_pages, generator=g).view(batch, pages_per_req)  # [B, P]
        last = kv_len - 1  # the new token's position: its K/V is written, then read with the rest
        out_slots = page_table[:, last // PAGE_SIZE] * PAGE_SIZE + last % PAGE_SIZE  # [B]
        self.meta = AttentionMetadata([1] * batch, [kv_len] * batch, page_table, out_slots, PAGE_SIZE)
        self.ids = torch.randint(0, cfg.vocab_size, (batch,), generator=g)  # [B]
        self.positions = torch.full((batch,), last)  # [B]
        self.model = model
        # what the step's attention reads: every layer's K and V of every request
        self.kv_bytes = cfg.num_layers * batch * kv_len * cfg.num_kv_heads * cfg.head_dim * 2 * self.cache.k[0].element_size()

    def __call__(self) -> torch.Tensor:
        self.attn.init_forward(self.meta)
        return self.model.compute_logits(self.model(self.ids, self.positions, self.attn))  # [B, vocab] float32


def linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's linear layers (the LM head among them): those hold_linear_weights_in converts."""
    return [m for m in model.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]


@contextmanager
def clocked(attn: TorchBackend, layers: list[torch.nn.Module], spent: Counter):
    """Within the block, attn.forward and every layer's forward add their seconds to spent["attention"], ["linear"]."""

    def wrap(fn, key):
        def run(*args):
            start = time.perf_counter()
            out = fn(*args)
            spent[key] += time.perf_counter() - start
            return out

        return run

    attn.forward = wrap(attn.forward, "attention")  # instance attributes shadow the methods
    for m in layers:
        m.forward = wrap(m.forward, "linear")
    try:
        yield
    finally:
        del attn.forward
        for m in layers:
            del m.forward


def gemm_only(model: torch.nn.Module, batch: int) -> tuple[float, int]:
    """(seconds, FLOPs) of the model's GEMMs alone at this batch: each layer's shape and weight dtype, probed."""
    shapes = Counter((*m.weight.shape, m.weight.dtype) for m in linears(model))  # (out n, in k, dtype)
    seconds = sum(count * gemm_seconds(batch, n, k, dtype) for (n, k, dtype), count in shapes.items())
    return seconds, sum(count * 2 * batch * n * k for (n, k, _), count in shapes.items())


def profile_batch(model: torch.nn.Module, cfg: ModelConfig, batch: int, kv_len: int, budget_s: float) -> dict:
    step, layers = DecodeStep(model, cfg, batch, kv_len), linears(model)
    plain, attention, linear, model_part, other = [], [], [], [], []
    with torch.inference_mode():
        for _ in range(2):
            step()  # first calls: kernel selection, allocation
        start = time.perf_counter()
        while len(plain) < 3 or (time.perf_counter() - start < budget_s and len(plain) < 50):
            t = time.perf_counter()
            step()
            plain.append(time.perf_counter() - t)
            spent: Counter = Counter()
            t = time.perf_counter()
            with clocked(step.attn, layers, spent):
                step()
            total = time.perf_counter() - t
            attention.append(spent["attention"])
            linear.append(spent["linear"])
            model_part.append(total - spent["attention"])  # the parts of one step, so they add up
            other.append(total - spent["attention"] - spent["linear"])
    step_s, attn_s, linear_s, model_s, other_s = map(statistics.median, (plain, attention, linear, model_part, other))
    gemm_s, flops = gemm_only(model, batch)
    gbps = step.kv_bytes / attn_s / 1e9
    return {
        "step_ms": step_s * 1e3, "attention_ms": attn_s * 1e3, "attention_gbps": gbps,
        "attention_copy_share": gbps / copy_gbps(), "linear_ms": linear_s * 1e3, "gemm_only_ms": gemm_s * 1e3,
        "model_ms": model_s * 1e3, "model_gflops": flops / model_s / 1e9, "gemm_gflops": flops / gemm_s / 1e9,
        "model_over_gemm": model_s / gemm_s, "other_ms": other_s * 1e3, "kv_bytes": step.kv_bytes, "flops": flops,
        "steps": len(plain),
    }  # fmt: skip


HEADER = (f"{'model':8} {'B':>3} {'step':>7} {'attn':>7} {'GB/s':>6} {'%copy':>6} {'linear':>7} {'gemm':>7} "
          f"{'model':>7} {'GFLOP/s':>8} {'probe':>7} {'x gemm':>7} {'other':>6}")  # fmt: skip


def mark(met: bool) -> str:
    return " " if met else "!"  # a missed goal


def table_row(name: str, batch: int, r: dict) -> str:
    share, over = r["attention_copy_share"], r["model_over_gemm"]
    return (f"{name:8} {batch:3} {r['step_ms']:7.2f} {r['attention_ms']:7.2f} {r['attention_gbps']:6.1f} "
            f"{100 * share:5.0f}%{mark(share >= ATTENTION_GOAL)}{r['linear_ms']:6.2f} {r['gemm_only_ms']:7.2f} "
            f"{r['model_ms']:7.2f} {r['model_gflops']:8.1f} {r['gemm_gflops']:7.1f} {over:6.2f}x{mark(over <= MODEL_GOAL)}"
            f"{r['other_ms']:5.2f}")  # fmt: skip


def roofline(a: argparse.Namespace) -> None:
    torch.set_num_threads(a.threads)
    print(host(), f"copy {copy_gbps():.1f} GB/s (read + write)", flush=True)
    print("ms per step; GB/s and %copy: attention's K+V reads; GFLOP/s: linear FLOPs over the model part (model) "
          "and over gemm-only (probe); x gemm: model part / gemm-only; ! marks a missed goal")  # fmt: skip
    print(HEADER)
    for name in a.models.split(","):
        path = model_dir(name)
        cfg = ModelConfig.from_dir(path)
        model = load_model(path, cfg, DTYPE, torch.device("cpu"), TPGroup())
        matmul = choose_matmul_dtype(DTYPE, torch.device("cpu"))
        if matmul.dtype != DTYPE:
            hold_linear_weights_in(model, matmul.dtype)
        rows = {}
        for batch in (int(b) for b in a.batches.split(",")):
            rows[str(batch)] = profile_batch(model, cfg, batch, a.kv_len, a.budget_s)
            print(table_row(name, batch, rows[str(batch)]), flush=True)
        store("roofline", f"{name}/{a.tag}", {
            "host": host(), "copy_gbps": copy_gbps(), "matmul_dtype": str(matmul.dtype).removeprefix("torch."),
            "matmul_reason": matmul.reason, "kv_len": a.kv_len, "page_size": PAGE_SIZE,
            "dtype": str(DTYPE).removeprefix("torch."), "batches": rows,
        })  # fmt: skip


# ---------------------------------------------------------------- py-spy


def bucket_samples(raw: Path, buckets) -> Counter:
    counts: Counter = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        names = [frame.split(" (")[0] for frame in stack.split(";")]
        if names and names[-1] in ("Socket.recv", "Poller.poll", "poll"):
            continue  # blocked waiting for the next message: idle
        for name, funcs in buckets:
            if any(f in names for f in funcs):
                counts[name] += int(n)
                break
        else:
            counts["other"] += int(n)
    return counts


def sampled(name: str, a: argparse.Namespace) -> None:
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(spy):
        raise SystemExit("py-spy is not installed: pip install py-spy")
    import radixrt

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(PROMPT)] for _ in range(BATCH)]
    sp = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    with radixrt.Engine(model_path=model_dir(name), dtype="bfloat16", page_size=16, max_running_requests=BATCH) as eng:
        eng.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 4})  # warm up
        pids = {p.name: p.pid for p in eng._backend.processes}
        out = Path(tempfile.mkdtemp())
        spies = {
            role: subprocess.Popen([spy, "record", "-p", str(pids[proc]), "-r", str(a.rate), "-f", "raw",
                                    "-o", str(out / f"{role}.txt"), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for role, proc in (("worker", "radixrt-worker-0"), ("scheduler", "radixrt-scheduler"))
        }  # fmt: skip
        time.sleep(1.0)  # py-spy attaches
        start = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - start
        for p in spies.values():
            p.send_signal(2)
        for p in spies.values():
            p.wait()
    worker = bucket_samples(out / "worker.txt", WORKER_BUCKETS)
    scheduler = sum(bucket_samples(out / "scheduler.txt", []).values())
    total = sum(worker.values()) + scheduler
    shares = {k: v / total for k, v in worker.items()} | {"scheduler": scheduler / total}
    overhead = sum(v for k, v in shares.items() if k not in ("model", "attention"))
    step_ms = wall / NEW * 1e3
    print(f"{name}, batch {BATCH}: {step_ms:.1f} ms per decode step ({BATCH * NEW / wall:.0f} tok/s)")
    for k, v in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"  {k:15} {100 * v:5.1f}%  {v * step_ms:6.2f} ms")
    print(f"  overhead (not model, not attention): {100 * overhead:.1f}%")
    store("runs", f"{name}/{a.tag}", {"step_ms": step_ms, "shares": shares, "overhead": overhead, "batch": BATCH})


def main() -> None:
    run_as_worker()
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="small,smollm2", help="comma-separated: tiny | small | smollm2 | a checkpoint directory")
    ap.add_argument("--tag", default="current", help="the name this run is stored under in the results (before, after)")
    ap.add_argument("--py-spy", action="store_true", help="sample a server's processes instead (see the docstring)")
    ap.add_argument("--rate", type=int, default=250, help="py-spy: samples per second")
    ap.add_argument("--batches", default="1,16,64", help="roofline: comma-separated decode batch sizes")
    ap.add_argument("--kv-len", type=int, default=600, help="roofline: KV tokens of every request")
    ap.add_argument("--budget-s", type=float, default=5.0, help="roofline: timing budget per model and batch")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="roofline: torch threads (the worker's: its cores)")
    a = ap.parse_args()
    if a.py_spy:
        for name in a.models.split(","):
            sampled(name, a)
    else:
        roofline(a)


if __name__ == "__main__":
    main()

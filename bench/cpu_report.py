"""One command for a CPU host's figures against vLLM-CPU, to be run first on any new host (an AMX
Xeon above all): what radixrt chose to run there and why, and how it compares.

For each model of the peers' yardstick (../shared/peers: tiny, small, smollm2; set up by its setup.sh):
  1. kernels: the attention variant of each shape class (decode, extend, cascade) that the
     start-up measurement picks for the model's shape, with every variant's time over the chosen
     one's (radixrt/kernels/kernel_choice.py; brgemm is the AMX-tile candidate);
  2. linears: the matmul dtype and weight packing a worker takes, and the model's four linear
     shapes timed at 1, 16, 64 and 512 rows through F.linear and through oneDNN-packed weights,
     interleaved: the ratio says whether packing beats F.linear on this host;
  3. the six workloads (W1..W6) through radixrt and vLLM, each system in one process as
     compare.sh runs them, plus W2 and W4 with one output token each: the prefill part of those
     workloads, and their decode part as the full time less it (the split issue 53 measured).
Ratios are vLLM's time over radixrt's (> 1: radixrt is faster), both run in this process's turn.
Writes bench/results/cpu_report.json; run it on a quiet machine.

    .venv/bin/python bench/cpu_report.py [--models tiny,small,smollm2] [--repeat 3] [--no-peers]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from common import ROOT, write_result
from peaks import host
from radixrt.kernels.kernel_choice import CLASSES, Shape, choose_kernels, median_ms
from radixrt.kernels.native_build import cpu_flags
from radixrt.models.cpu_matmul import choose_matmul_dtype, choose_weight_packing

PEERS = Path(os.environ.get("PEERS", Path.home() / ".cache" / "radixrt-peers"))
PEER_SCRIPTS = ROOT.parent / "shared" / "peers"
WORKLOADS = ("W1_rag", "W2_unique", "W3_multiturn", "W4_fork", "W5_single", "W6_long")
SPLITS = {"W2_unique": "W2_prefill", "W4_fork": "W4_prefill"}  # workload -> itself with one output token
ROWS = (1, 16, 64, 512)
# Runs a peer's bench script with SPLITS' workloads added (the driver imports `workloads` by that name).
WRAPPER = """import runpy, sys
bench, peers, splits = sys.argv[1], sys.argv[2], dict(s.split("=") for s in sys.argv[3].split(","))
sys.path.insert(0, peers)
import workloads
make = workloads.make_workloads
def with_prefills(*a, **k):
    wls = make(*a, **k)
    return wls | {prefill: dict(wls[full], max_new_tokens=1) for full, prefill in splits.items()}
workloads.make_workloads = with_prefills
sys.argv = [bench, *sys.argv[4:]]
runpy.run_path(bench, run_name="__main__")
"""


def model_config(model: Path) -> dict:
    return json.loads((model / "config.json").read_text())


def kernel_report(model: Path) -> dict:
    cfg = model_config(model)
    heads, hidden = cfg["num_attention_heads"], cfg["hidden_size"]
    shape = Shape(heads, cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or hidden // heads, 16, torch.bfloat16)
    choice = choose_kernels(shape)
    if choice is None:
        print("  attention: no compiled variant builds here (the torch path)")
        return {}
    print(f"  attention ({shape.heads} heads / {shape.kv_heads} KV, head_dim {shape.head_dim}): "
          + ", ".join(f"{c} {n}" for c, n in choice.names().items()) + f"\n    why: {choice.reason}")
    return {"attention": choice.names(), "reason": choice.reason}


def linear_report(model: Path) -> dict:
    cfg = model_config(model)
    heads, hidden, inter = cfg["num_attention_heads"], cfg["hidden_size"], cfg["intermediate_size"]
    kv, head_dim = cfg.get("num_key_value_heads", heads), cfg.get("head_dim") or hidden // heads
    cpu = torch.device("cpu")
    matmul = choose_matmul_dtype(torch.bfloat16, cpu)
    dtype, packing = matmul.dtype, choose_weight_packing(matmul.dtype, cpu)
    print(f"  linears: weights in {str(dtype).removeprefix('torch.')} ({matmul.reason}); packing: {packing.reason}")
    out = {"dtype": str(dtype), "dtype_reason": matmul.reason, "packing": packing.reason, "packed_over_linear": {}}
    if not packing.packed:
        return out
    shapes = {"qkv": (hidden, (heads + 2 * kv) * head_dim), "o": (heads * head_dim, hidden),
              "gate_up": (hidden, 2 * inter), "down": (inter, hidden)}  # fmt: skip
    for name, (k, n) in shapes.items():
        w = torch.randn(n, k).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
        ratios = {}
        for m in ROWS:
            x = torch.randn(m, k).to(dtype)
            ms = median_ms({"linear": lambda: F.linear(x, w),
                            "packed": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")}, rounds=15)
            ratios[m] = ms["packed"] / ms["linear"]
        out["packed_over_linear"][name] = ratios
        print(f"    {name:8} [{k} -> {n}] packed time / F.linear time: "
              + ", ".join(f"M={m} {r:.2f}x" for m, r in ratios.items()))
    return out


def run_peer(system: str, model: Path, repeat: int, out: Path, wrapper: Path) -> dict:
    """One system over the six workloads and SPLITS' prefills in one process; its results."""
    names = ",".join([*WORKLOADS, *SPLITS.values()])
    splits = ",".join(f"{full}={prefill}" for full, prefill in SPLITS.items())
    common = ["--model", str(model), "--repeat", str(repeat), "--workloads", names, "--out", str(out)]
    if system == "radixrt":
        cmd = [sys.executable, str(wrapper), str(PEER_SCRIPTS / "bench_radixrt.py"), str(PEER_SCRIPTS), splits,
               "--dtype", "bfloat16", *common]
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    else:  # as compare.sh runs it: its best dtype here, both cores, tcmalloc and iomp, from $PEERS
        dtype = "bfloat16" if {"avx512_bf16", "amx_bf16"} & (cpu_flags() or set()) else "float32"
        env = dict(os.environ, PYTHONSAFEPATH="1", VLLM_CPU_OMP_THREADS_BIND=f"0-{os.cpu_count() - 1}", VLLM_CPU_KVCACHE_SPACE="4",
                   LD_PRELOAD=f"/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:{PEERS}/peer-vllm/lib/libiomp5.so")
        env.pop("RADIXRT_WORKER_ENV", None)
        cmd = [str(PEERS / "peer-vllm" / "bin" / "python"), str(wrapper), str(PEER_SCRIPTS / "bench_vllm.py"),
               str(PEER_SCRIPTS), splits, "--dtype", dtype, "--prefix-caching", "on", *common]
        done = subprocess.run(cmd, cwd=PEERS, env=env, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"{system} on {model.name} failed ({done.returncode}): {done.stderr.strip()[-2000:]}")
    return json.loads(out.read_text())["results"]


def peers_report(model: Path, repeat: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        wrapper = Path(tmp) / "with_prefills.py"
        wrapper.write_text(WRAPPER)
        rt, vl = (run_peer(s, model, repeat, Path(tmp) / f"{s}.json", wrapper) for s in ("radixrt", "vllm"))
    wall = {s: {w: r[w]["wall_s"] for w in r} for s, r in (("radixrt", rt), ("vllm", vl))}
    print(f"  {'workload':14} {'radixrt':>9} {'vLLM':>9} {'ratio':>7}   (output tok/s; ratio > 1: radixrt faster)")
    for w in WORKLOADS:
        print(f"  {w:14} {rt[w]['output_tok_s']:9.0f} {vl[w]['output_tok_s']:9.0f} {wall['vllm'][w] / wall['radixrt'][w]:6.2f}x")
    split = {}
    for full, prefill in SPLITS.items():
        parts = {s: {"prefill": wall[s][prefill], "decode": wall[s][full] - wall[s][prefill]} for s in wall}
        split[full] = parts
        print(f"  {full} split (s): " + ", ".join(
            f"{p} radixrt {parts['radixrt'][p]:.2f} / vLLM {parts['vllm'][p]:.2f} ({parts['vllm'][p] / parts['radixrt'][p]:.2f}x)"
            for p in ("prefill", "decode")))  # fmt: skip
    return {"radixrt": rt, "vllm": vl, "split": split}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny,small,smollm2", help="models under $PEERS/models (../shared/peers/setup.sh)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per workload (the median is reported)")
    ap.add_argument("--no-peers", action="store_true", help="kernels and linears only, no workloads")
    a = ap.parse_args()
    where = host()
    print(f"host: {where['cpu']}; flags {' '.join(where['flags'])}; {where['cores']} cores, {where['threads']} torch threads")
    report = {"host": where, "models": {}}
    for name in a.models.split(","):
        model = PEERS / "models" / name
        if not (model / "config.json").exists():
            raise SystemExit(f"{model} is missing: run ../shared/peers/setup.sh first")
        print(f"\n== {name}")
        entry = {"kernels": kernel_report(model), "linears": linear_report(model)}
        if not a.no_peers:
            entry["peers"] = peers_report(model, a.repeat)
        report["models"][name] = entry
    print("wrote", write_result("cpu_report", report))


if __name__ == "__main__":
    main()

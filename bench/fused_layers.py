"""A decoder layer's non-GEMM work three ways (issue 30, item 3): torch ops, compiled C kernels, torch.compile.

The layer's norms (with the residual add), rope and act(gate) * up run through the model's
layer ops (radixrt/kernels/fused_layers.py; radixrt.models.llama.use_layer_ops), in one of:

    torch          the references: a handful of eager ops each, casting bf16 to float32 and back
    fused          csrc/fused_layers.c through ctypes (what the runtime uses on CPU)
    compile        torch.compile(dynamic=True) of each reference (inductor's CPU backend, C++ codegen)
    compile-layer  torch.compile(dynamic=True) of each DecoderLayer.forward, the references inside and
                   the attention backend's forward left out (torch._dynamo.disable): one graph before
                   attention (norm, qkv matmul, rope) and one after (o_proj .. down_proj)

Per model and decode batch, one process builds the model (bf16, CPU) and a KV pool with every
request at --kv-len tokens, then times whole decode steps (attention and logits included) with
the variants in turn, the order rotating each round (A B C D, B C D A, ...; --rounds), each
sample a few steps; each round gives the ratio of each variant's step time to the torch one,
and the medians of those ratios are the result (a neighbour slowing a round slows its samples
alike); a variant saves torch's median step time times (1 - its ratio). It also reports how
far each variant's logits are from torch's on that step (random KV: a sensitive step). Then
start-up, each in a fresh subprocess:

    compile cold/warm   the first decode steps at batch 1 and 16 (two graphs: dynamic=True still
                        specializes size 1) with an empty TORCHINDUCTOR_CACHE_DIR, then again on it
    fused build/load    building the kernels' object for this CPU's ISA into an empty folder, and
                        loading the cached one
    engine cold/warm    radixrt.Engine up to its first generated token, on the fused path with an
                        empty kernel cache (XDG_CACHE_HOME), then with it, and on the torch path

Prints a table and writes bench/results/fused_layers.json.

Measured (AMD EPYC with AVX-512, 2 cores shared with another engineer's jobs, bf16, KV 600, 11
rounds): fused/torch 0.90, 0.93, 0.96 on small at batch 1, 16, 64 and 0.88, 0.93, 0.92 on
smollm2, saving 1.6 to 8.1 ms a step, with logits bit-identical to torch's. torch.compile was
slower in 10 of 12 cases (per op 0.99-1.15, per layer 0.98-1.08: its guards and wrappers cost
more per call than its fusion saves at these sizes; with inductor on one thread, too), its
logits off by up to 32 on this sensitive step (it skips the bf16 roundings between ops), and it
adds 18-22 s to a process's start with an empty cache and 4-8 s with a warm one (two batch
shapes), where the C kernels build in 0.6 s once per machine and load in 3 ms. The runtime
keeps the C kernels; torch.compile is not wired in.

    .venv/bin/python bench/fused_layers.py [--models small,smollm2] [--batches 1,16,64] [--rounds 9]
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import ROOT, write_result

MODELS = Path.home() / ".cache" / "radixrt-peers" / "models"


@dataclass(frozen=True)
class Variant:
    name: str
    ops: Any  # the layer ops (radixrt/kernels/fused_layers.py: TorchLayers)
    compile_layers: bool = False  # run each DecoderLayer.forward through torch.compile


def use_variant(model: torch.nn.Module, v: Variant) -> None:
    from radixrt.models.llama import use_layer_ops

    use_layer_ops(model, v.ops)
    for layer in model.layers:
        layer.__dict__.pop("forward", None)  # the class's forward
        if v.compile_layers:  # compiled wrappers share the code object: one set of graphs for all layers
            layer.forward = torch.compile(layer.forward, dynamic=True)


def variants(names: list[str]) -> list[Variant]:
    """torch first (the ratios' base), then the named ones."""
    from radixrt.kernels.fused_layers import TORCH_LAYERS, load_fused_layers

    fused = load_fused_layers()
    assert fused is not None, "the fused kernels did not load (see the log)"
    every = {"fused": Variant("fused", fused), "compile": Variant("compile", compiled_layers()),
             "compile-layer": Variant("compile-layer", TORCH_LAYERS, compile_layers=True)}  # fmt: skip
    return [Variant("torch", TORCH_LAYERS)] + [every[n] for n in names if n != "torch"]


def compiled_layers():
    """TorchLayers whose methods are torch.compile'd references (compiled on first call)."""
    from radixrt.kernels.fused_layers import TorchLayers, act_mul_ref, add_rms_norm_ref, rms_norm_ref, rope_ref

    class CompiledLayers(TorchLayers):
        name = "compile"

        def __init__(self) -> None:
            jit = functools.partial(torch.compile, dynamic=True)
            self.rms_norm_fn, self.add_rms_norm_fn = jit(rms_norm_ref), jit(add_rms_norm_ref)
            self.rope_fn, self.act_mul_fn = jit(rope_ref), jit(act_mul_ref)

        def rms_norm(self, x, weight, eps, gemma=False):
            return self.rms_norm_fn(x, weight, eps, gemma)

        def add_rms_norm(self, x, residual, weight, eps, gemma=False):
            return self.add_rms_norm_fn(x, residual, weight, eps, gemma)

        def rope(self, q, k, cos, sin, rows):
            return self.rope_fn(q, k, cos, sin, rows)

        def act_mul(self, gate_up, act):
            return self.act_mul_fn(gate_up, act)

    return CompiledLayers()


class DecodeStep:
    """One model (bf16, CPU) and a decode batch of `batch` requests at kv_len tokens each; calling it
    runs one decode step (attention metadata, forward, logits)."""

    def __init__(self, path: Path, batch: int, kv_len: int, model=None) -> None:
        from radixrt.kernels import AttentionMetadata, PagedKVCache
        from radixrt.kernels.torch_backend import TorchBackend
        from radixrt.models import ModelConfig, load_model

        cfg = ModelConfig.from_dir(path)
        self.model = model or load_model(path, cfg, torch.bfloat16, torch.device("cpu"))
        ps, pages = 16, math.ceil(kv_len / 16)
        cache = PagedKVCache(cfg.num_layers, batch * pages + 1, ps, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16,
                             torch.device("cpu"))  # fmt: skip
        for t in cache.k + cache.v:
            t.normal_()
        self.attn = TorchBackend(cache, cfg.num_heads, cfg.head_dim, cfg.attention_layers())
        # outside any compiled graph (compile-layer): the backend's plans and ctypes kernel are not traceable
        self.attn.forward = torch._dynamo.disable(self.attn.forward)
        table = torch.arange(batch * pages).view(batch, pages) + 1  # [batch, pages]; page 0 unused
        slots = table[:, (kv_len - 1) // ps] * ps + (kv_len - 1) % ps
        self.meta = AttentionMetadata([1] * batch, [kv_len] * batch, table, slots, ps)
        self.ids = torch.randint(0, cfg.vocab_size, (batch,))
        self.pos = torch.full((batch,), kv_len - 1)

    def __call__(self) -> torch.Tensor:
        self.attn.init_forward(self.meta)
        return self.model.compute_logits(self.model(self.ids, self.pos, self.attn))


def timed(fn, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


def compare(step: DecodeStep, variants: list[Variant], rounds: int, steps: int) -> dict:
    """Median step time per variant and median of per-round ratios to variants[0], interleaved."""
    first_s = {}
    for v in variants:  # first steps: torch.compile compiles here (a graph per new batch shape)
        use_variant(step.model, v)
        first_s[v.name] = timed(step, 1)
        step()
    times: dict[str, list[float]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for v in variants[r % len(variants) :] + variants[: r % len(variants)]:
            use_variant(step.model, v)
            times[v.name].append(timed(step, steps))
    base = variants[0].name
    ratios = {
        v.name: statistics.median(t / b for t, b in zip(times[v.name], times[base], strict=True)) for v in variants[1:]
    }
    torch_ms = 1e3 * statistics.median(times[base])
    return {"median_ms": {k: 1e3 * statistics.median(t) for k, t in times.items()}, "ratio_to_torch": ratios,
            # the step time each variant saves: torch's median step times (1 - its median ratio)
            "saved_ms": {k: torch_ms * (1 - r) for k, r in ratios.items()},
            "first_step_ms": {k: 1e3 * t for k, t in first_s.items()}}  # fmt: skip


def equal_outputs(step: DecodeStep, variants: list[Variant]) -> dict[str, float]:
    """Each variant's largest |logit - torch's logit| on this step (0.0: the same numbers)."""
    outs = {}
    for v in variants:
        use_variant(step.model, v)
        outs[v.name] = step()
    ref = outs[variants[0].name]
    return {k: (o - ref).abs().max().item() for k, o in outs.items() if k != variants[0].name}


def steady(models: list[str], batches: list[int], kv_len: int, rounds: int, names: list[str]) -> dict:
    compared = variants(names)
    out = {}
    with torch.inference_mode():
        for name in models:
            model = None
            for batch in batches:
                step = DecodeStep(MODELS / name, batch, kv_len, model)
                model = step.model
                steps = max(1, 8 // max(1, batch // 8))  # ~ equal sample lengths across batches
                r = compare(step, compared, rounds, steps)
                r["max_abs_logit_diff"] = equal_outputs(step, compared)  # random KV: a chaotic, sensitive step
                out[f"{name}/b{batch}"] = r
                print_row(name, batch, r)
    return out


def print_row(name: str, batch: int, r: dict) -> None:
    cells = [f"{name:8s} b={batch:<3d} torch {r['median_ms']['torch']:7.2f} ms"]
    cells += [f"{k}/torch {v:.3f} (saves {r['saved_ms'][k]:+6.2f} ms, logits off by {r['max_abs_logit_diff'][k]:.3g})"
              for k, v in r["ratio_to_torch"].items()]  # fmt: skip
    print("  ".join(cells), flush=True)


# ---- start-up, in subprocesses ----------------------------------------------------------------


def child_compile(model: str, name: str) -> dict:
    """(subprocess) Model load, then the first compiled decode steps at batch 1 and 16."""
    start = time.perf_counter()
    step1 = DecodeStep(MODELS / model, 1, 64)
    loaded = time.perf_counter()
    use_variant(step1.model, next(v for v in variants([name]) if v.name == name))
    with torch.inference_mode():
        step1()
        step16 = DecodeStep(MODELS / model, 16, 64, step1.model)
        step16()
    return {"load_s": loaded - start, "compile_s": time.perf_counter() - loaded}


def child_engine(model: str) -> dict:
    """(subprocess) radixrt.Engine up to its first generated token."""
    import radixrt

    start = time.perf_counter()
    with radixrt.Engine(model_path=str(MODELS / model), device="cpu", dtype="bfloat16", max_total_tokens=4096) as e:
        ready = time.perf_counter()
        e.generate(input_ids=[1, 2, 3, 4], sampling_params={"max_new_tokens": 1, "temperature": 0})
        return {"ready_s": ready - start, "first_token_s": time.perf_counter() - start}


def run_child(mode: str, model: str, env: dict[str, str]) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", mode, "--models", model], env={**os.environ, **env},
                          capture_output=True, text=True, cwd=ROOT / "bench", check=False)  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"{mode} child failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def startup(model: str, repeats: int) -> dict:
    from radixrt.kernels import fused_layers, native_build

    res: dict = {"model": model}
    isa = native_build.chosen_isa()
    with tempfile.TemporaryDirectory() as d:
        t = time.perf_counter()
        lib = native_build.build(fused_layers.SOURCE, isa, Path(d))
        res["fused_build_s"] = time.perf_counter() - t
        t = time.perf_counter()
        native_build.build(fused_layers.SOURCE, isa, Path(d))
        fused_layers.FusedLayers(lib, isa)
        res["fused_load_s"] = time.perf_counter() - t
    for name in ("compile", "compile-layer"):
        res[f"{name}_cold"], res[f"{name}_warm"] = [], []
        for _ in range(repeats):
            with tempfile.TemporaryDirectory() as d:
                env = {"TORCHINDUCTOR_CACHE_DIR": d}
                res[f"{name}_cold"].append(run_child(name, model, env))
                res[f"{name}_warm"].append(run_child(name, model, env))
            print(
                f"{name} start-up ({model}): cold {res[f'{name}_cold'][-1]}, warm {res[f'{name}_warm'][-1]}", flush=True
            )
    res["engine_fused_cold"], res["engine_fused_warm"], res["engine_torch"] = [], [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as d:  # an empty kernel cache: every compiled kernel is built
            res["engine_fused_cold"].append(run_child("engine", model, {"XDG_CACHE_HOME": d}))
        res["engine_fused_warm"].append(run_child("engine", model, {}))
        res["engine_torch"].append(run_child("engine", model, {fused_layers.ENABLE_ENV: "0"}))
        print(f"engine start-up ({model}): fused cold {res['engine_fused_cold'][-1]}, warm {res['engine_fused_warm'][-1]},"
              f" torch path {res['engine_torch'][-1]}", flush=True)  # fmt: skip
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="small,smollm2")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--kv-len", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--startup-repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default="fused,compile,compile-layer", help="compared with torch, interleaved")
    ap.add_argument("--inductor-threads", type=int, default=0, help="inductor's cpp.threads (0: its default)")
    ap.add_argument("--skip-startup", action="store_true")
    ap.add_argument("--child", choices=["compile", "compile-layer", "engine"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch._dynamo.config.allow_unspec_int_on_nn_module = True  # Attention.layer: no recompile per layer
    if args.inductor_threads:
        import torch._inductor.config as inductor

        inductor.cpp.threads = args.inductor_threads
    models = args.models.split(",")
    if args.child:
        print(json.dumps(child_engine(models[0]) if args.child == "engine" else child_compile(models[0], args.child)))
        return
    result = {"threads": args.threads, "kv_len": args.kv_len, "rounds": args.rounds,
              "variants": args.variants, "inductor_threads": args.inductor_threads,
              "steady": steady(models, [int(b) for b in args.batches.split(",")], args.kv_len, args.rounds,
                               args.variants.split(","))}  # fmt: skip
    if not args.skip_startup:
        result["startup"] = startup(models[-1], args.startup_repeats)
    print("wrote", write_result("fused_layers", result))


if __name__ == "__main__":
    main()

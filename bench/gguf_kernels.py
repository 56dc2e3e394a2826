"""The products a held GGUF weight can go through, timed on model shapes beside bf16's F.linear on the same
weight dequantized (the baseline: what our bf16 serving computes), in one run:

  tiles        the ISA's integer tiles (VNNI where the CPU has it: csrc/qgemm.c), the few-row route
  amx          the AMX-INT8 tiles (where the CPU has amx_int8)
  dequantized  the weight dequantized per call (the compiled dequantizer) + F.linear: the many-row route
  int4pack     torch's _weight_int4pack_mm_for_cpu on the same 4-bit values (scale and zero per 32 in bf16,
               its contract: so not the file's float16 values exactly), the candidate issue 55 named
  bf16         F.linear over the dequantized weight held in bf16 (the baseline)

Shapes: SmolLM2-135M's (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536) and TinyLlama-1.1B's (qkv
2560x2048, gate_up 11264x2048, down 2048x5632); formats q4 (Q4_0/Q4_1/Q4_K) and q8 (Q8_0). Each figure is
a median in microseconds, with its ratio to bf16, under the allocator a worker starts with (peaks.run_as_worker:
a weight dequantized per call is a fresh tensor each time). Writes bench/results/gguf_kernels.json.

    .venv/bin/python bench/gguf_kernels.py [--rows 1,16,64,256] [--shapes smollm2,tinyllama]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from peaks import run_as_worker  # bench/, beside this script

from radixrt.kernels.native_build import cpu_flags, cpu_model
from radixrt.kernels.quant_weights import load_amx_qgemm, load_qgemm, pack

SHAPES = {"smollm2": [(960, 576), (576, 576), (3072, 576), (576, 1536)],
          "tinyllama": [(2560, 2048), (11264, 2048), (2048, 5632)]}
OUT = Path(__file__).parent / "results" / "gguf_kernels.json"


def median_us(fn, budget_s: float = 0.3) -> float:
    fn()
    times, start = [], time.perf_counter()
    while len(times) < 5 or (time.perf_counter() - start < budget_s and len(times) < 50):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def weight(fmt: str, n: int, k: int):
    g = torch.Generator().manual_seed(n * k)
    scales = torch.rand(n, k // 32, generator=g) * 0.01
    if fmt == "q8":
        return pack(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), scales), None
    values, mins = torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=g), -torch.rand(n, k // 32, generator=g) * 0.05
    s, m = scales.half().float(), mins.half().float()  # torch's element: (q - 8) scale + zero
    int4pack = (torch.ops.aten._convert_weight_to_int4pack_for_cpu(values.to(torch.int32), 1),
                torch.stack([s, m + 8 * s], dim=-1).transpose(0, 1).contiguous().bfloat16())
    return pack(values, scales, mins), int4pack


def ways(w, int4pack, tiles, amx, bf16_weight):
    out = {"tiles": lambda x: tiles(x, w, torch.bfloat16)}
    if amx is not None:
        out["amx"] = lambda x: amx(x, w, torch.bfloat16)
    out["dequantized"] = lambda x: F.linear(x, tiles.dequantize(w, torch.bfloat16))
    if int4pack is not None:
        out["int4pack"] = lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, int4pack[0], 32, int4pack[1])
    out["bf16"] = lambda x: F.linear(x, bf16_weight)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,16,64,256")
    ap.add_argument("--shapes", default="smollm2,tinyllama")
    a = ap.parse_args()
    run_as_worker()
    tiles, amx = load_qgemm(), load_amx_qgemm()
    flags = sorted(f for f in cpu_flags() or () if f in ("avx512_vnni", "avx512_bf16", "amx_int8", "amx_bf16", "avx_vnni"))
    print(f"{cpu_model()} ({' '.join(flags)}), {torch.get_num_threads()} threads; tiles: {tiles.isa.name}; "
          "us per product, and / bf16's F.linear", flush=True)
    results = {"cpu": cpu_model(), "flags": flags, "threads": torch.get_num_threads(), "tiles": tiles.isa.name, "runs": []}
    for model in a.shapes.split(","):
        for n, k in SHAPES[model]:
            for fmt in ("q4", "q8"):
                w, int4pack = weight(fmt, n, k)
                candidates = ways(w, int4pack, tiles, amx, tiles.dequantize(w, torch.bfloat16).contiguous())
                for rows in (int(r) for r in a.rows.split(",")):
                    x = torch.randn(rows, k).bfloat16()
                    us = {name: median_us(lambda fn=fn: fn(x)) for name, fn in candidates.items()}
                    results["runs"].append({"model": model, "n": n, "k": k, "format": fmt, "rows": rows, "us": us})
                    print(f"{model:9} {n:5}x{k:<5} {fmt} {rows:4} rows  " +
                          "  ".join(f"{name} {t:8.1f} ({t / us['bf16']:.2f}x)" for name, t in us.items()), flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

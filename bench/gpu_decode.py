"""GPU benchmark (scripts/gpu_check.sh runs it): decode tokens/s at batch 1, 32 and 128 and prefill
tokens/s on a ~1B random Llama in bf16, each printed beside the bound the hardware sets.
Decode runs from CUDA graphs (on CUDA with FlashInfer, unless --disable-cuda-graph); batch 1 is
also timed eagerly on the same runner for comparison, since that is where launch overhead shows most.

Decode is bandwidth-bound: a step reads every weight once and each sequence's KV, so
its bound is batch * HBM bandwidth / (weight bytes + KV bytes read). Prefill is
compute-bound: about 2 * parameters FLOPs per token, against peak dense bf16.
The schedule runs in this process (scheduler + model runner, no zmq), timing only
steps that are pure decode or pure prefill.

    python bench/gpu_decode.py                       # on the H200 (defaults: 4.8 TB/s, 989 TFLOP/s)
    python bench/gpu_decode.py --size 100m --device cpu --batches 1,4 --steps 3   # a smoke run here
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder only (gpu_check.sh runs python -P)

from common import TimedWorker, ensure_model, random_prompts, write_result  # noqa: E402


def run_batch(runner, args, batch: int) -> dict[str, float]:
    from radixrt.messages import TokenizedRequest
    from radixrt.sampling_params import SamplingParams
    from radixrt.config_views import SchedulerConfig
    from radixrt.scheduler.scheduler import Scheduler
    from radixrt.scheduler.step import drive

    sched = Scheduler(SchedulerConfig.of(args.server_args), runner.ready_message(), tokenizer=None)
    sp = SamplingParams(max_new_tokens=args.steps + 1, temperature=0, ignore_eos=True)
    for i, p in enumerate(random_prompts(batch, args.context, args.context, vocab=1000, seed=batch)):
        sched.add_request(TokenizedRequest(f"r{i}", p, sp))
    times = {"decode": [], "prefill": [], "prefill_tokens": 0}
    timed = TimedWorker(runner)
    drive(sched, timed)
    for b, dt in timed.steps:
        n = [len(e.input_ids) for e in b.entries]
        if all(x == 1 for x in n) and len(n) == batch:
            times["decode"].append(dt)
        elif all(x > 1 for x in n):
            times["prefill"].append(dt)
            times["prefill_tokens"] += sum(n)
    decode = sorted(times["decode"])[len(times["decode"]) // 2]  # median step
    return {"decode_step_s": decode, "decode_tok_s": batch / decode,
            "prefill_tok_s": times["prefill_tokens"] / sum(times["prefill"]) if times["prefill"] else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batches", default="1,32,128")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=32, help="decode steps per batch")
    parser.add_argument("--hbm-tbs", type=float, default=4.8, help="HBM bandwidth, TB/s (H200: 4.8)")
    parser.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak, TFLOP/s (H200: 989)")
    parser.add_argument("--disable-cuda-graph", action="store_true", help="run decode eagerly throughout")
    args = parser.parse_args()
    from radixrt.config import ServerArgs
    from radixrt.worker.model_runner import ModelRunner

    batches = [int(b) for b in args.batches.split(",")]
    path = ensure_model("llama", args.size)
    args.server_args = ServerArgs(model_path=str(path), dtype="bfloat16", device=args.device, page_size=16,
                                  max_running_requests=max(batches), chunked_prefill_size=8192,
                                  max_total_tokens=max(batches) * (args.context + args.steps + 32),
                                  disable_cuda_graph=args.disable_cuda_graph)
    start = time.perf_counter()
    runner = ModelRunner(args.server_args)
    graph_sizes = runner.graphs.sizes if runner.graphs is not None else []
    print(f"runner ready in {time.perf_counter() - start:.1f} s; decode CUDA graphs: "
          + (f"{len(graph_sizes)} sizes, batch {graph_sizes[0]} to {graph_sizes[-1]}" if graph_sizes else "off"))
    params = sum(p.numel() for p in runner.model.parameters())
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    run_batch(runner, args, 1)  # warm-up: kernel compilation (FlashInfer JIT) and allocator
    rows = {}
    print(f"\n== llama-{args.size}: {params / 1e9:.2f}B parameters (bf16, {weight_bytes / 2**30:.2f} GiB) on {args.device}, "
          f"context {args.context}, attention {type(runner.attn).__name__}, decode {'from CUDA graphs' if graph_sizes else 'eager'}")
    print(f"{'batch':>6} {'decode tok/s':>13} {'bound tok/s':>12} {'of bound':>9} {'prefill tok/s':>14} {'bound tok/s':>12} {'of bound':>9}")
    for batch in batches:
        r = run_batch(runner, args, batch)
        kv_bytes = batch * (args.context + args.steps // 2) * runner.bytes_per_token
        r["decode_bound_tok_s"] = batch * args.hbm_tbs * 1e12 / (weight_bytes + kv_bytes)
        r["prefill_bound_tok_s"] = args.peak_tflops * 1e12 / (2 * params)
        rows[batch] = r
        print(f"{batch:>6} {r['decode_tok_s']:>13.0f} {r['decode_bound_tok_s']:>12.0f} {r['decode_tok_s'] / r['decode_bound_tok_s']:>9.1%} "
              f"{r['prefill_tok_s']:>14.0f} {r['prefill_bound_tok_s']:>12.0f} {r['prefill_tok_s'] / r['prefill_bound_tok_s']:>9.1%}")
    eager_b1 = None
    if runner.graphs is not None:  # the same runner with its graphs set aside: every step eager
        graphs, runner.graphs = runner.graphs, None
        eager_b1 = run_batch(runner, args, 1)["decode_tok_s"]
        runner.graphs = graphs
        graph_b1 = f"; from the graph: {rows[1]['decode_tok_s']:.0f} tok/s" if 1 in rows else ""
        print(f"batch 1 decode eager (no CUDA graph): {eager_b1:.0f} tok/s{graph_b1}")
    print("wrote", write_result("gpu_decode", {"size": args.size, "device": args.device, "params": params,
                                               "context": args.context, "hbm_tbs": args.hbm_tbs, "peak_tflops": args.peak_tflops,
                                               "cuda_graph_sizes": graph_sizes, "eager_batch1_decode_tok_s": eager_b1,
                                               "rows": rows}))


if __name__ == "__main__":
    main()

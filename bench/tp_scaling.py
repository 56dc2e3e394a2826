"""Tensor-parallel scaling on CPU: the ~100M random Llama at tp 1 and tp 2 in one run.

Prints output tokens/s for both and the ratio, and where tp 2's time goes:
communication is measured with gloo between two processes on the tensor shapes
this workload sends (two all-reduces of [tokens, hidden] per layer per step,
one all-gather of the logits), then scaled by the run's step and token counts;
the rest of the wall time is compute and overhead.

    .venv/bin/python bench/tp_scaling.py [--num-prompts 32]
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from common import ensure_model, random_prompts, write_result

OUTPUT_LEN = 32


def run_engine(path, prompts, tp: int) -> tuple[float, int]:
    import radixrt

    sp = {"max_new_tokens": OUTPUT_LEN, "temperature": 0, "ignore_eos": True}
    with radixrt.Engine(model_path=str(path), dtype="bfloat16", tp_size=tp, page_size=16,
                        max_total_tokens=sum(len(p) for p in prompts) + 64 * OUTPUT_LEN + 4096, log_level="warning") as e:
        e.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 2})  # warm up
        t = time.perf_counter()
        out = e.generate(input_ids=prompts, sampling_params=sp)
        return time.perf_counter() - t, sum(o["meta_info"]["completion_tokens"] for o in out)


def _collective_worker(rank: int, port: int, shapes: list[tuple[int, int]], vocab_cols: int, result) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    times = {}
    for rows, hidden in shapes:
        x = torch.randn(rows, hidden, dtype=torch.bfloat16)
        for _ in range(3):
            dist.all_reduce(x)
        t = time.perf_counter()
        for _ in range(20):
            dist.all_reduce(x)
        times[(rows, hidden)] = (time.perf_counter() - t) / 20
    g = [torch.empty(64, vocab_cols) for _ in range(2)]
    t = time.perf_counter()
    for _ in range(20):
        dist.all_gather(g, torch.randn(64, vocab_cols))
    times["gather"] = (time.perf_counter() - t) / 20
    if rank == 0:
        result.update({str(k): v for k, v in times.items()})
    dist.destroy_process_group()


def collective_costs(hidden: int, vocab: int, rows: list[int]) -> dict[str, float]:
    with mp.Manager() as manager:
        result = manager.dict()
        port = 29500 + os.getpid() % 1000
        mp.spawn(_collective_worker, args=(port, [(r, hidden) for r in rows], vocab // 2, result), nprocs=2, join=True)
        return dict(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=32)
    args = parser.parse_args()
    path = ensure_model("llama", "100m")
    prompts = random_prompts(args.num_prompts, 200, 400, vocab=1000, seed=0)
    runs = {tp: run_engine(path, prompts, tp) for tp in (1, 2)}
    tok_s = {tp: n / s for tp, (s, n) in runs.items()}
    print(f"\n== llama-100m (bf16), {len(prompts)} prompts of 200-400 tokens x {OUTPUT_LEN} output tokens")
    for tp, (s, n) in runs.items():
        print(f"tp {tp}: {tok_s[tp]:8.1f} output tok/s ({s:.2f} s)")
    print(f"ratio tp2 / tp1: {tok_s[2] / tok_s[1]:.2f}x")

    # Communication of the tp 2 run: 2 all-reduces per layer per step, one logits gather per step.
    layers, hidden, vocab = 12, 768, 32000
    prefill_tokens = sum(len(p) for p in prompts)
    decode_steps = OUTPUT_LEN - 1
    prefill_steps = max(1, -(-prefill_tokens // 4096))
    costs = collective_costs(hidden, vocab, [len(prompts), 4096])
    decode_comm = decode_steps * (2 * layers * costs[str((len(prompts), hidden))] + costs["gather"])
    prefill_comm = prefill_steps * 2 * layers * costs[str((4096, hidden))] * (prefill_tokens / (prefill_steps * 4096))
    comm = decode_comm + prefill_comm
    wall = runs[2][0]
    print(f"tp 2 time: {wall:.2f} s; communication (gloo, measured per shape, scaled) ~{comm:.2f} s "
          f"({comm / wall:.0%}): decode {decode_comm:.2f} s, prefill {prefill_comm:.2f} s; compute and overhead ~{wall - comm:.2f} s")
    print("NOTE: 2 ranks on a 2-core machine split the same cores that tp 1 uses with 2 threads; a real speedup "
          "needs ranks on separate devices or sockets. This run shows the machinery and its communication cost.")
    path_out = write_result("tp_scaling", {
        "workload": f"{len(prompts)} prompts 200-400 tok, {OUTPUT_LEN} out, bf16 100M",
        "tok_s": tok_s, "ratio_tp2_tp1": tok_s[2] / tok_s[1], "wall_s": {tp: s for tp, (s, _) in runs.items()},
        "collective_s": costs, "tp2_comm_estimate_s": comm, "tp2_decode_comm_s": decode_comm, "tp2_prefill_comm_s": prefill_comm,
    })
    print("wrote", path_out)


if __name__ == "__main__":
    main()

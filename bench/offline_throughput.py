"""Offline throughput: radixrt.Engine vs transformers' batched, padded generate, same run.

Workload (issue 2): 64 unique prompts of 200-800 tokens, 64 output tokens each,
greedy, ignore_eos. Prints output tokens/s for both and the ratio, and where
radixrt's time goes (an in-process replay of the same schedule with timers
around each stage; the difference to the engine's wall time is what the
process hops and the frontend cost).

    .venv/bin/python bench/offline_throughput.py [--models tiny,100m,DIR] [--num-prompts 64]

--models takes the builder's sizes (tiny: float32; 100m, 1b: bfloat16) or checkpoint
directories (bfloat16), e.g. the peers' `small`, which is 100m's shape with an 8,192-token
vocabulary instead of 32,000: run both to see what the vocabulary does to the ratio.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from common import TimedWorker, ensure_model, random_prompts, write_result

OUTPUT_LEN = 64


def run_radixrt(path: Path, prompts: list[list[int]], dtype: str) -> float:
    import radixrt

    total = sum(len(p) + OUTPUT_LEN for p in prompts)
    with radixrt.Engine(model_path=str(path), dtype=dtype, page_size=16, max_total_tokens=total + 4096) as e:
        e.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 4})  # warm up
        t = time.perf_counter()
        out = e.generate(input_ids=prompts, sampling_params={"max_new_tokens": OUTPUT_LEN, "temperature": 0, "ignore_eos": True})
        elapsed = time.perf_counter() - t
    assert all(o["meta_info"]["completion_tokens"] == OUTPUT_LEN for o in out)
    return elapsed


def run_transformers(path: Path, prompts: list[list[int]], dtype: str, batch_size: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    t = time.perf_counter()
    for i in range(0, len(prompts), batch_size):
        chunk = prompts[i : i + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=OUTPUT_LEN, min_new_tokens=OUTPUT_LEN,
                do_sample=False, top_k=None, top_p=None, temperature=None, pad_token_id=0,
            )
        assert out.shape[1] == width + OUTPUT_LEN
    return time.perf_counter() - t


def profile_stages(path: Path, prompts: list[list[int]], dtype: str) -> dict[str, float]:
    """Replay the workload in this process (scheduler + model runner, no zmq) with stage timers."""
    from radixrt.config import ServerArgs
    from radixrt.messages import TokenizedRequest
    from radixrt.sampling_params import SamplingParams
    from radixrt.scheduler.scheduler import Scheduler
    from radixrt.scheduler.step import drive
    from radixrt.worker.model_runner import ModelRunner

    total = sum(len(p) + OUTPUT_LEN for p in prompts)
    args = ServerArgs(model_path=str(path), dtype=dtype, page_size=16, max_total_tokens=total + 4096)
    runner = ModelRunner(args)
    sched = Scheduler(args, runner.ready_message(), tokenizer=None)
    timers = {"scheduler": 0.0, "attention": 0.0, "sampling": 0.0, "forward_total": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            r = fn(*a, **k)
            timers[name] += time.perf_counter() - t
            return r

        return wrapper

    runner.attn.forward = timed("attention", runner.attn.forward)
    runner.sampler.sample = timed("sampling", runner.sampler.sample)
    sp = SamplingParams(max_new_tokens=OUTPUT_LEN, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        sched.add_request(TokenizedRequest(f"r{i}", p, sp))
    timed = TimedWorker(runner)
    start = time.perf_counter()
    drive(sched, timed)
    timers["in_process_total"] = time.perf_counter() - start
    timers["forward_total"] = sum(seconds for _, seconds in timed.steps)
    timers["scheduler"] = timers["in_process_total"] - timers["forward_total"]  # schedule, process, the loop
    timers["model_other"] = timers["forward_total"] - timers["attention"] - timers["sampling"]
    return timers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,100m")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--hf-batch-size", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    results = {}
    for size in args.models.split(","):
        if Path(size).expanduser().is_dir():
            path, dtype, size = Path(size).expanduser(), "bfloat16", Path(size).name
        else:
            path, dtype = ensure_model("llama", size), "float32" if size == "tiny" else "bfloat16"
        prompts = random_prompts(args.num_prompts, 200, 800, vocab=1000, seed=0)
        n_out = len(prompts) * OUTPUT_LEN
        ours = run_radixrt(path, prompts, dtype)
        theirs = run_transformers(path, prompts, dtype, args.hf_batch_size)
        stages = profile_stages(path, prompts, dtype)
        row = {
            "dtype": dtype,
            "radixrt_s": ours,
            "transformers_s": theirs,
            "radixrt_tok_s": n_out / ours,
            "transformers_tok_s": n_out / theirs,
            "ratio": theirs / ours,
            "stages_s": stages,
            "process_and_frontend_overhead_s": ours - stages["in_process_total"],
        }
        results[size] = row
        print(f"\n== llama-{size} ({dtype}), {len(prompts)} prompts x {OUTPUT_LEN} output tokens")
        print(f"radixrt      {row['radixrt_tok_s']:9.1f} output tok/s  ({ours:.2f} s)")
        print(f"transformers {row['transformers_tok_s']:9.1f} output tok/s  ({theirs:.2f} s)")
        print(f"ratio radixrt / transformers: {row['ratio']:.2f}x")
        print("where radixrt's time goes (in-process replay):")
        for k in ("scheduler", "attention", "sampling", "model_other", "in_process_total"):
            print(f"  {k:18s} {stages[k]:8.2f} s")
        print(f"  {'zmq+processes+frontend':18s} {row['process_and_frontend_overhead_s']:8.2f} s (engine wall - in-process)")
    print("\nwrote", write_result("offline_throughput", {"workload": "64 prompts 200-800 tok, 64 out, greedy", "results": results}))


if __name__ == "__main__":
    main()

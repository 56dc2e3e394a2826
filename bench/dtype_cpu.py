"""float32 vs bfloat16 on this CPU: the measurement behind `--dtype auto` on CPU (radixrt/models/dtype.py).

SGLang's auto rule serves float32 checkpoints in float16 (bfloat16 for Gemma); on
CUDA radixrt follows it. This bench asks whether a CPU should downcast too. Each
model gets two model runners in this process, float32 and bfloat16 (as served: on
a CPU without bf16 GEMM units the linear layers compute in float32 on the bf16
weights, cpu_matmul.py), each under its own scheduler (no processes, no zmq), and
the two run the same work in alternation:

    prefill: --prefill-prompts fresh prompts of --prefill-len tokens, 1 output token each
    decode:  --decode-prompts 16-token prompts, --decode-len output tokens each (ignore_eos)

Prefill takes the fastest of --repeats rounds, decode the fastest decode step of
all rounds: on a shared machine (other jobs took 50-90% of these 2 cores when this
was measured; median steps were 6-20x the fastest) the fastest time is the one a
neighbour did not stretch, and only the ratio of the two dtypes, measured in
alternation, means something. Prints tokens/s per dtype and
bf16/fp32 speed ratios (> 1: bfloat16 is faster); writes bench/results/dtype_cpu.json.

    .venv/bin/python bench/dtype_cpu.py [--models tiny,100m] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from common import TimedWorker, ensure_model, random_prompts, write_result

DTYPES = ("float32", "bfloat16")


class Model:
    """One dtype's runner and scheduler, fed in this process."""

    def __init__(self, path: Path, dtype: str) -> None:
        from radixrt.config import ServerArgs
        from radixrt.scheduler.scheduler import Scheduler
        from radixrt.worker.model_runner import ModelRunner

        args = ServerArgs(model_path=str(path), dtype=dtype, device="cpu", page_size=16, max_total_tokens=16384,
                          chunked_prefill_size=4096, disable_radix_cache=True)
        self.runner = ModelRunner(args)
        self.sched = Scheduler(args, self.runner.ready_message(), tokenizer=None)
        self.vocab = self.runner.cfg.vocab_size

    def step_times(self, prompts: list[list[int]], max_new_tokens: int) -> list[float]:
        """Seconds of each model forward (schedule and bookkeeping excluded) until the prompts finish."""
        from radixrt.messages import TokenizedRequest
        from radixrt.sampling_params import SamplingParams
        from radixrt.scheduler.step import drive

        sp = SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True)
        for i, p in enumerate(prompts):
            self.sched.add_request(TokenizedRequest(f"{time.monotonic_ns()}-{i}", p, sp))
        timed = TimedWorker(self.runner)
        drive(self.sched, timed)
        return [seconds for _, seconds in timed.steps]


def bench_model(path: Path, args: argparse.Namespace) -> dict[str, float]:
    models = {d: Model(path, d) for d in DTYPES}
    vocab = models["float32"].vocab
    prefill_s = {d: float("inf") for d in DTYPES}
    decode_steps: dict[str, list[float]] = {d: [] for d in DTYPES}
    for rep in range(args.repeats):
        prefill = random_prompts(args.prefill_prompts, args.prefill_len, args.prefill_len, vocab, seed=rep)
        decode = random_prompts(args.decode_prompts, 16, 16, vocab, seed=100 + rep)
        for d in DTYPES if rep % 2 == 0 else DTYPES[::-1]:  # alternate the order against drift
            prefill_s[d] = min(prefill_s[d], sum(models[d].step_times(prefill, 1)))
            decode_steps[d] += models[d].step_times(decode, args.decode_len)[1:]  # the first step is the prefill
        print(f"  round {rep}: prefill s " + ", ".join(f"{d} {prefill_s[d]:.3f}" for d in DTYPES), flush=True)
    tokens = args.prefill_prompts * args.prefill_len
    out: dict[str, float] = {}
    for d in DTYPES:
        out[f"{d}_prefill_tok_s"] = tokens / prefill_s[d]
        out[f"{d}_decode_tok_s"] = args.decode_prompts / min(decode_steps[d])
        out[f"{d}_decode_median_tok_s"] = args.decode_prompts / statistics.median(decode_steps[d])
    for phase in ("prefill", "decode"):
        out[f"bf16_over_fp32_{phase}"] = out[f"bfloat16_{phase}_tok_s"] / out[f"float32_{phase}_tok_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,100m", help="make_tiny_model sizes (llama) or checkpoint directories")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--prefill-prompts", type=int, default=4)
    parser.add_argument("--prefill-len", type=int, default=256)
    parser.add_argument("--decode-prompts", type=int, default=8)
    parser.add_argument("--decode-len", type=int, default=32)
    args = parser.parse_args()
    results = {}
    for name in args.models.split(","):
        path = ensure_model("llama", name) if name in ("tiny", "100m", "1b") else Path(name)
        print(f"{name} ({path}):", flush=True)
        results[name] = row = bench_model(path, args)
        print("  " + ", ".join(f"{k} {v:,.2f}" for k, v in row.items()), flush=True)
    print("wrote", write_result("dtype_cpu", {"workload": vars(args), "models": results}))


if __name__ == "__main__":
    main()

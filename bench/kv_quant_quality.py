"""Quality of a quantized KV pool: each kv_cache_dtype against the model's own dtype, same prompts.

For llama-tiny (float32) and llama-100m (bfloat16), with the torch attention
backend on the CPU:
  * perplexity of held-out text (the corpus tail, which no prompt is cut from),
    fed in prefill chunks so that every chunk reads the earlier ones, and its
    own K/V, back from the pool;
  * top-1 agreement over >= 1,000 generated tokens: the model's own dtype
    generates greedily; each quantized pool then runs the same tokens as
    decode steps (teacher-forced, so one early flip does not make every later
    position differ) and we count the steps whose argmax is the token the
    model's dtype chose, and record the largest |logit difference| there;
  * the greedy run of the quantized pool itself (free-running): the fraction
    of generated tokens equal to the model dtype's, position by position;
  * the pool's bytes per token.

    .venv/bin/python bench/kv_quant_quality.py [--models tiny,100m]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from common import ROOT, ensure_model, write_result
from radixrt.kernels import AttentionMetadata
from radixrt.models import ModelConfig

KV_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
PAGE_SIZE = 16
NUM_PROMPTS, PROMPT_LEN, GEN_LEN = 8, 96, 128  # 8 x 128 = 1,024 generated tokens
NUM_DOCS, DOC_LEN, CHUNK = 4, 256, 64  # held-out perplexity text


class PoolRun:
    """One model over a pool of one KV dtype, built by the worker's ModelRunner; request i owns its own pages.

    Drives the attention backend and the model directly (no scheduler) so that every position's full
    logits are at hand.
    """

    def __init__(self, path: Path, kv_dtype: str, num_reqs: int, max_len: int) -> None:
        from radixrt.config import ServerArgs
        from radixrt.worker.model_runner import ModelRunner

        pages = math.ceil(max_len / PAGE_SIZE)
        args = ServerArgs(
            model_path=str(path), kv_cache_dtype=kv_dtype, page_size=PAGE_SIZE, attention_backend="torch",
            device="cpu", max_total_tokens=num_reqs * pages * PAGE_SIZE,
        )
        self.runner = ModelRunner(args)
        self.table = torch.arange(num_reqs * pages).view(num_reqs, pages)  # [num_reqs, pages]
        self.lens = [0] * num_reqs

    @torch.inference_mode()
    def step(self, new_ids: list[list[int]]) -> list[torch.Tensor]:
        """Append new_ids[i] to request i (all requests each step) -> per request logits [len, vocab] float32."""
        qo = [len(ids) for ids in new_ids]
        positions = torch.cat([torch.arange(n, n + q) for n, q in zip(self.lens, qo)])  # [T]
        rows = torch.repeat_interleave(torch.arange(len(qo)), torch.tensor(qo))  # [T] request of each token
        out_slots = self.table[rows, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE
        self.lens = [n + q for n, q in zip(self.lens, qo)]
        meta = AttentionMetadata(qo, list(self.lens), self.table, out_slots, PAGE_SIZE)
        self.runner.attn.init_forward(meta)
        ids = torch.tensor([t for seq in new_ids for t in seq])
        hidden = self.runner.model(ids, positions, self.runner.attn)  # [T, hidden]
        return list(self.runner.model.compute_logits(hidden).float().split(qo))


def perplexity(path: Path, kv_dtype: str, docs: list[list[int]]) -> float:
    run = PoolRun(path, kv_dtype, len(docs), DOC_LEN)
    nll, count = 0.0, 0
    for c in range(0, DOC_LEN, CHUNK):
        logits = run.step([d[c : c + CHUNK] for d in docs])
        for d, lg in zip(docs, logits):
            targets = torch.tensor(d[c + 1 : c + CHUNK + 1])  # the last chunk's last row has no target
            logp = torch.log_softmax(lg[: len(targets)], -1)
            nll -= logp.gather(1, targets[:, None]).sum().item()
            count += len(targets)
    return math.exp(nll / count)


def generate(path: Path, kv_dtype: str, prompts: list[list[int]], forced: list[list[int]] | None = None):
    """Greedy decode GEN_LEN tokens per prompt -> tokens [B, GEN_LEN], logits [B, GEN_LEN, vocab], pool bytes/token.

    With `forced`, each step feeds forced[i][t] instead of the argmax (teacher forcing); the
    returned tokens are still the argmaxes.
    """
    run = PoolRun(path, kv_dtype, len(prompts), PROMPT_LEN + GEN_LEN)
    logits = [lg[-1] for lg in run.step(prompts)]
    steps_logits, steps_tokens = [], []
    for t in range(GEN_LEN):
        last = torch.stack(logits)  # [B, vocab]
        steps_logits.append(last)
        steps_tokens.append(last.argmax(-1))
        feed = steps_tokens[-1].tolist() if forced is None else [f[t] for f in forced]
        if t + 1 < GEN_LEN:
            logits = [lg[-1] for lg in run.step([[x] for x in feed])]
    return torch.stack(steps_tokens, 1), torch.stack(steps_logits, 1), run.runner.bytes_per_token


def corpus_split(path: Path) -> tuple[list[int], list[int]]:
    """The corpus tokens: prompts come from the head, held-out perplexity text from the tail."""
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(path).encode((ROOT / "scripts" / "data" / "corpus.txt").read_text())
    held_out = NUM_DOCS * DOC_LEN
    return ids[:-held_out], ids[-held_out:]


def compare(path: Path, kv_dtype: str, prompts, docs, ref_tokens: torch.Tensor, ref_logits: torch.Tensor) -> dict:
    """One pool against the model dtype's greedy tokens and logits."""
    t = time.perf_counter()
    top1, logits, bytes_per_token = generate(path, kv_dtype, prompts, forced=ref_tokens.tolist())
    free = generate(path, kv_dtype, prompts)[0] if kv_dtype != "auto" else ref_tokens
    return {
        "bytes_per_token": bytes_per_token,
        "perplexity": perplexity(path, kv_dtype, docs),
        "top1_agreement": (top1 == ref_tokens).float().mean().item(),
        "max_logit_diff": (logits - ref_logits).abs().max().item(),
        "mean_logit_diff": (logits - ref_logits).abs().mean().item(),
        "free_run_agreement": (free == ref_tokens).float().mean().item(),
        "seconds": time.perf_counter() - t,
    }


def evaluate(size: str) -> dict:
    path = ensure_model("llama", size)
    head, tail = corpus_split(path)
    stride = (len(head) - PROMPT_LEN) // NUM_PROMPTS
    prompts = [head[i * stride : i * stride + PROMPT_LEN] for i in range(NUM_PROMPTS)]
    docs = [tail[i * DOC_LEN : (i + 1) * DOC_LEN] for i in range(NUM_DOCS)]
    ref_tokens, ref_logits, _ = generate(path, "auto", prompts)
    rows = {kv_dtype: compare(path, kv_dtype, prompts, docs, ref_tokens, ref_logits) for kv_dtype in KV_DTYPES}
    for r in rows.values():
        r["perplexity_change"] = r["perplexity"] / rows["auto"]["perplexity"] - 1
    return {"dtype": ModelConfig.from_dir(path).torch_dtype, "generated_tokens": ref_tokens.numel(), "kv_dtypes": rows}


def print_table(size: str, result: dict) -> None:
    print(f"\n== llama-{size} ({result['dtype']}), {result['generated_tokens']} generated tokens, "
          f"{NUM_DOCS} x {DOC_LEN} held-out tokens")
    print(f"{'kv dtype':10s} {'bytes/tok':>9s} {'ppl':>10s} {'ppl vs auto':>11s} {'top-1 agree':>11s} "
          f"{'max |dlogit|':>12s} {'mean |dlogit|':>13s} {'free-run agree':>14s}")
    for kv_dtype, r in result["kv_dtypes"].items():
        print(f"{kv_dtype:10s} {r['bytes_per_token']:9d} {r['perplexity']:10.1f} {r['perplexity_change']:+11.3%} "
              f"{r['top1_agreement']:11.4f} {r['max_logit_diff']:12.4f} {r['mean_logit_diff']:13.5f} "
              f"{r['free_run_agreement']:14.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny,100m")
    args = parser.parse_args()
    results = {}
    for size in args.models.split(","):
        results[size] = evaluate(size)
        print_table(size, results[size])
    workload = (f"{NUM_PROMPTS} prompts x {PROMPT_LEN} tokens, {GEN_LEN} greedy tokens each (teacher-forced for "
                f"top-1/logits); perplexity over {NUM_DOCS} x {DOC_LEN} held-out tokens in chunks of {CHUNK}")
    print("\nwrote", write_result("kv_quant_quality", {"workload": workload, "results": results}))


if __name__ == "__main__":
    main()

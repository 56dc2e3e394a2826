"""Precision regression of the quantized KV pool on the demo model, which knows its answers.

The demo model (assets/world-llama, scripts/train_demo_model.py) answers
questions about an invented world; scripts/world.py holds the held-out answer
key. For each kv_cache_dtype, through the real engine (scheduler + worker
processes, greedy decoding):

  * exact-match accuracy on the answer key: facts (recall, in a phrasing
    training never used), arithmetic (operand pairs training never showed),
    number-dense tables (a few rows in the prompt), long contexts (the
    question after 1,000+ tokens of table), and all together;

and teacher-forced over the pool (radixrt.worker.kv_calibration, the same
functions the server's start-up check uses):

  * perplexity of held-out generated text (answered held-out questions and tables);
  * top-1 agreement with the model-dtype KV and the largest |delta logprob| of
    its top token, over that text and the long-table prompts;
  * the start-up check's own agreement on its built-in prompts (what
    --kv-quant-min-agreement is compared with).

The fp8 pools run twice: with the per-layer scales the start-up check fits,
and with every scale 1.0 (a scales file of ones), to show what fitting buys.

    .venv/bin/python bench/kv_quant_quality.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from common import ROOT, write_result  # puts scripts/ on sys.path

import world  # noqa: I001 (scripts/world.py: the answer key)

import radixrt
from radixrt.worker.kv_calibration import compare_logits, teacher_forced_logits

MODEL = ROOT / "assets" / "world-llama"
KV_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
# fp8 again with every scale 1.0 (what the pool did before the start-up check fitted them)
UNIT_SCALES = ("fp8_e4m3", "fp8_e5m2")
PAGE_SIZE = 16
MAX_ANSWER_TOKENS = 12


def pool_args(kv_dtype: str, scales_file: str | None) -> dict:
    return {"model_path": str(MODEL), "kv_cache_dtype": kv_dtype, "kv_scales_file": scales_file,
            "kv_quant_min_agreement": 0.0, "page_size": PAGE_SIZE}


def answers(pool: dict, items: list[world.Item]) -> list[str]:
    """The engine's greedy reply to every item's prompt over the pool."""
    with radixrt.Engine(**pool, max_total_tokens=1 << 16) as engine:
        outs = engine.generate([it.prompt for it in items],
                               {"temperature": 0, "max_new_tokens": MAX_ANSWER_TOKENS})
    return [o["text"] for o in outs]


def teacher_forced(pool: dict, seqs: list[list[int]]):
    """Every position's logits over the pool, and the start-up check's report (None for auto)."""
    from radixrt.config import ServerArgs
    from radixrt.worker.model_runner import ModelRunner

    pages = len(seqs) * math.ceil(max(map(len, seqs)) / PAGE_SIZE)
    args = ServerArgs(**pool, device="cpu", max_total_tokens=max(pages, 256) * PAGE_SIZE)
    runner = ModelRunner(args)
    return teacher_forced_logits(runner.model, runner.attn, seqs), runner.kv_check


def perplexity(logits: list[torch.Tensor], seqs: list[list[int]]) -> float:
    nll = sum(-torch.log_softmax(lg[:-1], -1).gather(1, torch.tensor(s[1:])[:, None]).sum().item()
              for lg, s in zip(logits, seqs))
    return math.exp(nll / sum(len(s) - 1 for s in seqs))


def pools(scales_dir: Path) -> dict[str, dict]:
    """Row name -> pool arguments: every kv dtype, then fp8 with unit scales."""
    layers = json.loads((MODEL / "config.json").read_text())["num_hidden_layers"]
    ones = scales_dir / "unit_scales.json"
    ones.write_text(json.dumps({"k_scale": [1.0] * layers, "v_scale": [1.0] * layers}))
    rows = {kv: pool_args(kv, None) for kv in KV_DTYPES}
    rows |= {f"{kv} (scales 1.0)": pool_args(kv, str(ones)) for kv in UNIT_SCALES}
    return rows


def evaluate(items: list[world.Item], tokenizer, scales_dir: Path) -> dict:
    held_out = [tokenizer.encode(t, add_special_tokens=False) for t in world.held_out_text()]
    long_prompts = [tokenizer.encode(it.prompt + it.answer, add_special_tokens=False)
                    for it in items if it.subset == "long"][:4]
    rows = {}
    ref_logits = None
    for kv_dtype, pool in pools(scales_dir).items():
        t = time.perf_counter()
        acc = world.accuracy(items, answers(pool, items))
        logits, check = teacher_forced(pool, held_out + long_prompts)
        if ref_logits is None:
            ref_logits = logits
        report = compare_logits(torch.cat(ref_logits), torch.cat(logits))
        rows[kv_dtype] = {
            "accuracy": acc,
            "perplexity": perplexity(logits[: len(held_out)], held_out),
            "top1_agreement": report.top1_agreement,
            "max_abs_dlogprob": report.max_abs_dlogprob,
            "mean_abs_dlogprob": report.mean_abs_dlogprob,
            "startup_check": None if check is None else vars(check),
            "seconds": round(time.perf_counter() - t, 1),
        }
        print(f"{kv_dtype}: {rows[kv_dtype]}", flush=True)
    base = rows["auto"]
    for r in rows.values():  # against the model-dtype pool of this run
        r["perplexity_vs_auto"] = r["perplexity"] / base["perplexity"]
        r["accuracy_vs_auto"] = r["accuracy"]["all"] - base["accuracy"]["all"]
    return rows


def print_table(rows: dict, counts: dict) -> None:
    subsets = [*world.SUBSETS, "all"]
    print("\nexact-match accuracy (items: " + ", ".join(f"{s} {counts[s]}" for s in subsets) + ")")
    print(f"{'kv dtype':21s} " + " ".join(f"{s:>10s}" for s in subsets)
          + f" {'all-auto':>8s} {'ppl':>7s} {'ppl/auto':>8s} {'top-1 agree':>11s} {'max|dlogp|':>10s} {'start-up':>8s}")
    for kv_dtype, r in rows.items():
        check = r["startup_check"]["top1_agreement"] if r["startup_check"] else float("nan")
        print(f"{kv_dtype:21s} " + " ".join(f"{r['accuracy'][s]:10.3f}" for s in subsets)
              + f" {r['accuracy_vs_auto']:+8.3f} {r['perplexity']:7.3f} {r['perplexity_vs_auto']:8.4f}"
              f" {r['top1_agreement']:11.4f} {r['max_abs_dlogprob']:10.4f} {check:8.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a sample of the answer key instead of all of it")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    items = (world.sample_key({"facts": 60, "arithmetic": 60, "tables": 40, "long": 10}) if args.quick
             else world.answer_key())
    counts = {s: sum(it.subset == s for it in items) for s in world.SUBSETS}
    counts["all"] = len(items)
    with tempfile.TemporaryDirectory() as scales_dir:
        rows = evaluate(items, AutoTokenizer.from_pretrained(MODEL), Path(scales_dir))
    print_table(rows, counts)
    workload = (f"answer key of scripts/world.py ({counts}), greedy, <= {MAX_ANSWER_TOKENS} new tokens, exact match; "
                f"perplexity and agreement teacher-forced over world.held_out_text() and 4 long-table prompts")
    print("\nwrote", write_result("kv_quant_quality", {"model": str(MODEL.relative_to(ROOT)), "workload": workload,
                                                     "items": counts, "kv_dtypes": rows}))


if __name__ == "__main__":
    main()

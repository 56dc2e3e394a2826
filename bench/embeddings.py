"""/v1/embeddings throughput at batch 64 against transformers, and the time a chat saves it.

For each model (the tiny llama and qwen2, hidden 64, and SmolLM2-135M, hidden 576, GQA 3:1,
vocab 49152, by default; `--models llama-100m` names the 100M bench llama), 64 documents cut from the shipped corpus (DOC_TOKENS
each) are embedded in float32:

  transformers   AutoModel on the padded batch of 64, last-token pooling, L2-normalized, in
                 this process (what a sentence-transformers pipeline runs for a decoder model)
  radixrt cold   one /v1/embeddings call of the 64 documents on a server whose cache was flushed
  radixrt warm   the same call after each document was read by a /generate of the document plus
                 a question (max_new_tokens 1): the documents' KV is in the radix cache
  mean cold/warm the same two on a server pooling by the mean (--pooler-config MEAN): every
                 row's hidden state is needed, so the cached prefix is not reused

Each is the median of ROUNDS rounds (the cache flushed before each cold round and before each
chat), on one machine in one run; the figures printed are ratios: radixrt's documents per second
over transformers', and cold time over warm time. Writes bench/results/embeddings.json and
embeddings.png.

    .venv/bin/python bench/embeddings.py [--models llama,qwen2,smollm2] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import requests
import torch
from common import RESULTS, ROOT, ensure_model, write_result

sys.path.insert(0, str(ROOT / "tests"))
from support.helpers import corpus_prompts
from support.server_proc import running_server

BATCH, DOC_TOKENS, QUESTION = 64, 200, "\nQuestion: what is this passage about?\nAnswer:"
SERVER = ("--page-size", "16", "--max-total-tokens", "65536", "--dtype", "float32")


def model_path(name: str) -> Path:
    if name == "smollm2":  # the real trained model (hidden 576, GQA 3:1, vocab 49152), from PyPI
        from make_smollm2 import ensure_smollm2

        return ensure_smollm2().hf_dir
    family, _, size = name.partition("-")
    return ensure_model(family, size or "tiny")


def transformers_seconds(path: Path, docs: list[list[int]], rounds: int) -> float:
    from transformers import AutoModel

    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    width = max(len(d) for d in docs)
    ids = torch.tensor([d + [0] * (width - len(d)) for d in docs])
    mask = torch.tensor([[1] * len(d) + [0] * (width - len(d)) for d in docs])
    last = mask.sum(1) - 1

    def once() -> torch.Tensor:
        with torch.no_grad():
            h = model(input_ids=ids, attention_mask=mask).last_hidden_state
        return torch.nn.functional.normalize(h[torch.arange(len(docs)), last], dim=-1)

    once()  # warm-up
    return _median(once, rounds)


def _median(fn: Any, rounds: int, before: Any = None) -> float:
    times = []
    for _ in range(rounds):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def server_seconds(url: str, docs: list[list[int]], rounds: int, question: list[int]) -> dict[str, float]:
    """cold and warm medians, and the share of prompt tokens the warm call found cached."""
    def flush() -> None:
        requests.post(url + "/flush_cache", timeout=60).raise_for_status()

    def embed() -> dict[str, Any]:
        r = requests.post(url + "/v1/embeddings", json={"input": docs}, timeout=600)
        r.raise_for_status()
        return r.json()

    def chat_first() -> None:
        flush()
        r = requests.post(url + "/generate", json={"input_ids": [d + question for d in docs],
                                                    "sampling_params": {"max_new_tokens": 1}}, timeout=600)
        r.raise_for_status()

    embed()  # warm-up
    cold = _median(embed, rounds, flush)
    warm = _median(embed, rounds, chat_first)
    chat_first()
    usage = embed()["usage"]
    return {"cold_s": cold, "warm_s": warm, "warm_cached_share": usage["prompt_tokens_details"]["cached_tokens"]
            / usage["prompt_tokens"]}


def run_model(name: str, rounds: int) -> dict[str, Any]:
    path = model_path(name)
    docs = corpus_prompts(path, [DOC_TOKENS] * BATCH, seed=64)
    from transformers import AutoTokenizer

    question = AutoTokenizer.from_pretrained(path).encode(QUESTION)
    out: dict[str, Any] = {"transformers_s": transformers_seconds(path, docs, rounds)}
    with running_server(path, *SERVER) as (url, _):
        out["last"] = server_seconds(url, docs, rounds, question)
    with running_server(path, *SERVER, "--pooler-config", '{"pooling_type": "MEAN"}') as (url, _):
        out["mean"] = server_seconds(url, docs, rounds, question)
    out["throughput_ratio"] = out["transformers_s"] / out["last"]["cold_s"]  # radixrt docs/s over transformers'
    for pooling in ("last", "mean"):
        out[pooling]["cold_over_warm"] = out[pooling]["cold_s"] / out[pooling]["warm_s"]
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    base = [results[n]["transformers_s"] for n in names]  # each model's bars over its transformers throughput
    bars = {"radixrt cold": [b / results[n]["last"]["cold_s"] for n, b in zip(names, base)],
            "radixrt, documents chatted first": [b / results[n]["last"]["warm_s"] for n, b in zip(names, base)],
            "radixrt mean pooling, chatted first": [b / results[n]["mean"]["warm_s"] for n, b in zip(names, base)]}
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(bars)
    for k, (label, values) in enumerate(bars.items()):
        ax.bar([i + k * width for i in range(len(names))], values, width, label=label)
    ax.axhline(1.0, color="black", linewidth=0.8, label="transformers (batch of 64, padded)")
    ax.set_yscale("log")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(names))], names)
    ax.set_ylabel(f"embedding throughput / transformers'\n(batch {BATCH}, {DOC_TOKENS} tokens, float32)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="llama,qwen2,smollm2")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    results = {name: run_model(name, args.rounds) for name in args.models.split(",")}
    for name, r in results.items():
        print(f"{name}: radixrt/transformers throughput {r['throughput_ratio']:.2f}x; chatted first: last-token "
              f"{r['last']['cold_over_warm']:.2f}x faster ({r['last']['warm_cached_share']:.1%} cached), mean "
              f"{r['mean']['cold_over_warm']:.2f}x ({r['mean']['warm_cached_share']:.1%} cached)")
    write_result("embeddings", {"batch": BATCH, "doc_tokens": DOC_TOKENS, "rounds": args.rounds, "models": results})
    plot(results, RESULTS / "embeddings.png")


if __name__ == "__main__":
    if sys.argv[1:] == ["--plot-only"]:  # redraw from the last results
        import json

        plot(json.loads((RESULTS / "embeddings.json").read_text())["models"], RESULTS / "embeddings.png")
    else:
        main()

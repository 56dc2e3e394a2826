"""CPU microbenchmark of the sparse MoE block (radixrt/models/moe.py), float32, one rank.

Candidates, each the whole block (router, experts, weighted sum) on [T, hidden]:
  radixrt       SparseMoE as it runs on CPU: the (token, slot) pairs grouped by expert, each
                expert run once on all its pairs, by whichever of the next two it picks
  grouped_mm    torch's grouped GEMM, one call per projection (use_grouped_mm=True)
  looped        a Python loop over the experts that got pairs (use_grouped_mm=False)
  naive         every expert on every token, weighted by a [T, E] matrix that is zero off
                the top-k: the per-expert dense loop
  hf_grouped    transformers 5's own block (Qwen3MoeSparseMoeBlock / MixtralSparseMoeBlock)
                with its default experts implementation, grouped_mm
  hf_eager      the same block with experts_implementation="eager" (a loop over hit experts)
Shapes: a Qwen3-MoE-like layer (many small experts, top-8) and a Mixtral-like one (8 large
experts, top-2), scaled down to fit a small machine; decode batches (1, 8, 64 tokens) and
prefill chunks (512, 2048). Prints ms per call and each one's ratio to radixrt's;
writes bench/results/moe_cpu.json.

    .venv/bin/python bench/moe_cpu.py [--quick] [--threads N]
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
from common import write_result
from radixrt.models.moe import SparseMoE, grouped_experts, route
from radixrt.models.parallel import TPGroup
from torch import nn

# name -> (hidden, expert intermediate, experts, top_k)
SHAPES = {"qwen3_moe-like": (1024, 384, 64, 8), "mixtral-like": (1024, 1792, 8, 2)}
TOKENS = (1, 8, 64, 512, 2048)


def transformers_block(family: str, hidden: int, inter: int, experts: int, top_k: int,
                       implementation: str) -> nn.Module:
    if family.startswith("qwen3"):
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

        cfg = Qwen3MoeConfig(hidden_size=hidden, moe_intermediate_size=inter, num_experts=experts,
                             num_experts_per_tok=top_k, norm_topk_prob=True, experts_implementation=implementation)
        return Qwen3MoeSparseMoeBlock(cfg).eval()
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=hidden, intermediate_size=inter, num_local_experts=experts,
                        num_experts_per_tok=top_k, experts_implementation=implementation)
    return MixtralSparseMoeBlock(cfg).eval()


def naive_block(moe: SparseMoE) -> Callable[[torch.Tensor], torch.Tensor]:
    """Every expert on every token; routing as SparseMoE's, so the outputs agree."""

    def run(x: torch.Tensor) -> torch.Tensor:
        routing = route(moe.gate(x), moe.top_k, moe.renormalize)
        combine = torch.zeros(x.shape[0], moe.num_experts).scatter_(1, routing.experts, routing.weights)  # [T, E]
        out = torch.zeros_like(x)
        for e in range(moe.num_experts):
            gate, up = torch.nn.functional.linear(x, moe.w13[e]).chunk(2, dim=-1)
            out += combine[:, e, None] * torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, moe.w2[e])
        return out

    return run


def best_ms(candidates: dict[str, Callable[[], object]], budget_s: float) -> dict[str, float]:
    """Best ms of each candidate, timed in interleaved rounds (each once per round) so that a
    machine whose load drifts slows every candidate alike; at least 3 rounds, more within budget_s."""
    for fn in candidates.values():
        fn()
    best = {name: float("inf") for name in candidates}
    spent, rounds = 0.0, 0
    while rounds < 3 or (spent < budget_s and rounds < 30):
        for name, fn in candidates.items():
            start = time.perf_counter()
            fn()
            took = time.perf_counter() - start
            best[name], spent = min(best[name], took), spent + took
        rounds += 1
    return {name: t * 1e3 for name, t in best.items()}


@torch.no_grad()
def bench_shape(name: str, tokens: tuple[int, ...], budget_s: float) -> dict[str, dict[str, float]]:
    hidden, inter, experts, top_k = SHAPES[name]
    block = transformers_block(name, hidden, inter, experts, top_k, "grouped_mm")
    for p in block.parameters():
        p.normal_(0, 0.05)
    eager = transformers_block(name, hidden, inter, experts, top_k, "eager")
    eager.load_state_dict(block.state_dict())
    moe = SparseMoE(hidden, inter, experts, top_k, True, TPGroup(), float32_scaling=name.startswith("mixtral"))
    for key, tensor in block.state_dict().items():
        moe.load(key, tensor)
    moe.check_loaded()
    naive = naive_block(moe)

    def forced(use_grouped_mm: bool) -> Callable[[torch.Tensor], torch.Tensor]:
        def run(x: torch.Tensor) -> torch.Tensor:
            routing = route(moe.gate(x), moe.top_k, moe.renormalize)
            return grouped_experts(x, moe.w13, moe.w2, routing.experts, routing.weights, use_grouped_mm)

        return run

    grouped_mm, looped = forced(True), forced(False)
    rows = {}
    for t in tokens:
        x = torch.randn(t, hidden)
        torch.testing.assert_close(moe(x), block(x[None])[0], atol=1e-4, rtol=1e-4)
        ms = best_ms({
            "radixrt": lambda: moe(x),
            "grouped_mm": lambda: grouped_mm(x),
            "looped": lambda: looped(x),
            "naive": lambda: naive(x),
            "hf_grouped": lambda: block(x[None]),
            "hf_eager": lambda: eager(x[None]),
        }, budget_s)
        ratios = {f"{k}/radixrt": v / ms["radixrt"] for k, v in ms.items() if k != "radixrt"}
        rows[str(t)] = ms | ratios
        print(f"{name:15s} T={t:5d}  radixrt {ms['radixrt']:8.2f} ms  "
              + "  ".join(f"{k} {v:5.2f}x" for k, v in ratios.items()), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer token counts and shorter timing")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tokens = (1, 64, 512) if args.quick else TOKENS
    budget = 1.0 if args.quick else 4.0
    results = {name: bench_shape(name, tokens, budget) for name in SHAPES}
    print("wrote", write_result("moe_cpu", {"shapes": {k: list(v) for k, v in SHAPES.items()}, "ms": results,
                                            "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()

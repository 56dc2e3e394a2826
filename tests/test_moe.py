"""The sparse MoE block (radixrt/models/moe.py) against transformers' Qwen3-MoE and Mixtral
blocks, loaded through our loader from both layouts: the fused 3-D tensors of the in-memory
block's state_dict and the per-expert tensors save_pretrained writes (read as safetensors
slices), in float32 and bf16. Also: tensor-parallel shards summing to the whole, every way of
running the experts (grouped GEMM, loop, capturable) computing the same, experts without
tokens, the loader's errors, and the hook for an installed fused kernel."""

from __future__ import annotations

import sys
import types
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest
import torch
from radixrt.models.moe import (
    SparseMoE,
    capturable_experts,
    find_fused_kernel,
    grouped_experts,
    moe_tensor_suffix,
    route,
    use_grouped_mm,
)
from radixrt.models.parallel import TPGroup
from safetensors import safe_open
from torch import nn

HIDDEN, INTER, EXPERTS = 32, 16, 8
FAMILIES = ("qwen3_moe_norm", "qwen3_moe", "mixtral")


@dataclass
class Reference:
    """A one-layer transformers model of a family, saved; its layer-0 MoE block is the reference."""

    model: nn.Module
    block: nn.Module
    path: Path  # save_pretrained output: the per-expert Hub layout
    renormalize: bool
    float32_scaling: bool

    def moe(self, tp: TPGroup = TPGroup(), layout: str = "fused", dtype: torch.dtype = torch.float32) -> SparseMoE:
        top_k = self.block.gate.top_k
        moe = SparseMoE(HIDDEN, INTER, EXPERTS, top_k, self.renormalize, tp, self.float32_scaling)
        if layout == "fused":  # the in-memory names: gate.weight, experts.gate_up_proj, experts.down_proj
            for name, tensor in self.block.state_dict().items():
                moe.load(name, tensor)
        else:
            with safe_open(str(self.path / "model.safetensors"), framework="pt") as f:
                for name in f.keys():
                    suffix = moe_tensor_suffix(name)
                    if suffix is not None:
                        moe.load(suffix, f.get_slice(name))
        moe.check_loaded()
        return moe.to(dtype)


def build_reference(family: str, top_k: int, root: Path) -> Reference:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common = dict(vocab_size=64, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=16, num_experts_per_tok=top_k)
    if family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(intermediate_size=INTER, num_local_experts=EXPERTS, **common))
    else:
        cfg = Qwen3MoeConfig(intermediate_size=64, moe_intermediate_size=INTER, num_experts=EXPERTS,
                             norm_topk_prob=family == "qwen3_moe_norm", **common)
        model = Qwen3MoeForCausalLM(cfg)
    block = model.model.layers[0].mlp
    gen = torch.Generator().manual_seed(10 * FAMILIES.index(family) + top_k)
    with torch.no_grad():  # spread the router (Qwen3 initializes it to zeros) and the experts
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    path = root / f"{family}-k{top_k}"
    model.save_pretrained(path)
    return Reference(model.eval(), block, path, family != "qwen3_moe", family == "mixtral")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Callable[[str, int], Reference]:
    root, built = tmp_path_factory.mktemp("moe"), {}

    def get(family: str, top_k: int = 2) -> Reference:
        if (family, top_k) not in built:
            built[family, top_k] = build_reference(family, top_k, root)
        return built[family, top_k]

    return get


def inputs(tokens: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(dtype)


def naive_moe(x, w13, w2, experts, weights) -> torch.Tensor:
    """Per token, per slot: the plainest statement of the block (float32, small T only)."""
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for slot in range(experts.shape[1]):
            e = int(experts[t, slot])
            gate, up = (w13[e] @ x[t]).chunk(2)
            out[t] += weights[t, slot] * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@contextmanager
def experts_implementation(ref: Reference, name: str) -> Iterator[None]:
    """transformers 5 runs its experts by grouped_mm unless told "eager" (the standalone block's)."""
    ref.model.set_experts_implementation(name)
    try:
        yield
    finally:
        ref.model.set_experts_implementation("grouped_mm")


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("implementation", ["grouped_mm", "eager"])
@torch.no_grad()
def test_matches_transformers_float32(reference, family, top_k, implementation):
    """Loaded from either layout, on 1, 3 and 300 tokens (with k * T < E, most experts get none)."""
    ref = reference(family, top_k)
    loaded = [ref.moe(layout=layout) for layout in ("fused", "per_expert")]
    with experts_implementation(ref, implementation):
        for tokens in (1, 3, 300):
            x = inputs(tokens)
            expected = ref.block(x[None])[0]
            for moe in loaded:
                torch.testing.assert_close(moe(x), expected, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("top_k", [2, 4])
@torch.no_grad()
def test_half_precision_rounds_where_transformers_does(reference, family, top_k):
    """bf16 against transformers' default path: the same ops in the same order give the same
    bits, which needs each family's dtype for the routing weights (flipping float32_scaling
    changes the output) and its order of summing the k outputs (checked at k = 4)."""
    ref = reference(family, top_k)
    block = ref.block.to(torch.bfloat16)
    try:
        x = inputs(64, torch.bfloat16)
        expected = block(x[None])[0]
        moe = ref.moe(dtype=torch.bfloat16)
        assert torch.equal(moe(x), expected)
        moe.float32_scaling = not moe.float32_scaling
        assert not torch.equal(moe(x), expected)
        moe.float32_scaling = not moe.float32_scaling
        for name in ("w13", "w2"):  # held in float32 as cpu_matmul.py holds linear weights: bf16 out
            setattr(moe, name, nn.Parameter(getattr(moe, name).float(), requires_grad=False))
        out = moe(x)
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out, expected, atol=0.05, rtol=0.02)
    finally:
        block.float()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@torch.no_grad()
def test_tensor_parallel_shards_sum_to_the_whole(reference, family, layout):
    ref = reference(family)
    whole = ref.moe(layout=layout)
    shards = [ref.moe(TPGroup(rank, 2), layout) for rank in range(2)]
    assert shards[0].w13.shape == (EXPERTS, INTER, HIDDEN) and shards[0].w2.shape == (EXPERTS, HIDDEN, INTER // 2)
    for tokens in (1, 3, 300):
        x = inputs(tokens)
        total = shards[0].partial_output(x) + shards[1].partial_output(x)
        torch.testing.assert_close(total, whole(x), atol=1e-5, rtol=1e-5)


def random_experts(tokens: int, top_k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.3
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.3
    x = torch.randn(tokens, HIDDEN, generator=gen)
    routing = route(torch.randn(tokens, EXPERTS, generator=gen), top_k, renormalize=True)
    return x, w13, w2, routing.experts, routing.weights


def all_paths(x, w13, w2, experts, weights) -> dict[str, torch.Tensor]:
    return {
        "grouped_mm": grouped_experts(x, w13, w2, experts, weights, use_grouped_mm=True),
        "looped": grouped_experts(x, w13, w2, experts, weights, use_grouped_mm=False),
        "capturable": capturable_experts(x, w13, w2, experts, weights),
    }


@pytest.mark.parametrize("tokens,top_k", [(0, 2), (1, 2), (3, 1), (3, 2), (300, 2)])
@torch.no_grad()
def test_every_path_computes_the_same(tokens, top_k):
    """capturable_experts: T * k < E takes the gathered branch (1 and 3 tokens), the rest runs
    every expert. The grouped GEMM and the loop agree bit for bit, in float32 and in bf16."""
    x, w13, w2, experts, weights = random_experts(tokens, top_k)
    out = all_paths(x, w13, w2, experts, weights)
    assert torch.equal(out["grouped_mm"], out["looped"])
    torch.testing.assert_close(out["capturable"], out["looped"], atol=1e-5, rtol=1e-5)
    half = all_paths(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), experts, weights.bfloat16())
    assert torch.equal(half["grouped_mm"], half["looped"])


def test_cpu_takes_the_grouped_gemm_for_decode_batches_only():
    w13 = torch.empty(64, 768, 1024)  # float32
    assert use_grouped_mm(torch.empty(64, 1024), w13, top_k=8)  # 2 MiB of pairs
    assert not use_grouped_mm(torch.empty(2048, 1024), w13, top_k=8)  # 64 MiB


@torch.no_grad()
def test_experts_without_tokens():
    """The first and last experts (and others) get no tokens; the rest several each."""
    x, w13, w2, _, _ = random_experts(5, 2)
    experts = torch.tensor([[1, 2], [2, 1], [3, 6], [6, 1], [4, 2]])
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(1))
    expected = naive_moe(x, w13, w2, experts, weights)
    for name, out in all_paths(x, w13, w2, experts, weights).items():
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_checkpoint_names():
    assert moe_tensor_suffix("model.layers.3.block_sparse_moe.experts.0.w1.weight") == "experts.0.w1.weight"
    assert moe_tensor_suffix("model.layers.3.mlp.gate.weight") == "gate.weight"
    assert moe_tensor_suffix("model.layers.0.mlp.experts.gate_up_proj") == "experts.gate_up_proj"
    assert moe_tensor_suffix("model.layers.3.mlp.gate_proj.weight") is None  # a dense MLP
    assert moe_tensor_suffix("model.layers.3.self_attn.q_proj.weight") is None


def test_loader_names_what_is_wrong():
    moe = SparseMoE(HIDDEN, INTER, EXPERTS, 2, True, TPGroup())
    with pytest.raises(ValueError, match="not a tensor of a sparse MoE block"):
        moe.load("experts.0.q_proj.weight", torch.zeros(INTER, HIDDEN))
    with pytest.raises(ValueError, match="expert 8 is out of range"):
        moe.load("experts.8.w1.weight", torch.zeros(INTER, HIDDEN))
    with pytest.raises(ValueError, match=r"shape \(16, 16\), expected \(16, 32\)"):
        moe.load("experts.0.w1.weight", torch.zeros(INTER, HIDDEN // 2))
    with pytest.raises(ValueError, match="not divisible by tp_size 3"):
        SparseMoE(HIDDEN, INTER, EXPERTS, 2, True, TPGroup(0, 3))
    moe.load("gate.weight", torch.zeros(EXPERTS, HIDDEN))
    moe.load("experts.gate_up_proj", torch.zeros(EXPERTS, 2 * INTER, HIDDEN))
    for e in range(EXPERTS - 1):
        moe.load(f"experts.{e}.down_proj.weight", torch.zeros(HIDDEN, INTER))
    with pytest.raises(ValueError, match=r"1 pieces: \['experts.7.down'\]"):
        moe.check_loaded()


@torch.no_grad()
def test_an_importable_fused_kernel_is_used(monkeypatch):
    """A fused kernel found on import gets vLLM's arguments: w13 and w2 as stored, float32
    weights and int32 expert ids; its output is the block's."""
    calls = []

    def fused_experts(x, w1, w2, topk_weights, topk_ids):
        calls.append((topk_weights.dtype, topk_ids.dtype))
        return grouped_experts(x, w1, w2, topk_ids.long(), topk_weights, use_grouped_mm=False)

    module = types.ModuleType("vllm.model_executor.layers.fused_moe.fused_moe")
    module.fused_experts = fused_experts
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers", "vllm.model_executor.layers.fused_moe"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert find_fused_kernel() is fused_experts

    x, w13, w2, _, _ = random_experts(3, 2)
    moe = SparseMoE(HIDDEN, INTER, EXPERTS, 2, True, TPGroup())
    moe.gate.weight.normal_()
    moe.w13.copy_(w13)
    moe.w2.copy_(w2)
    expected = moe(x)
    moe.fused = find_fused_kernel()
    torch.testing.assert_close(moe(x), expected)
    assert calls == [(torch.float32, torch.int32)]

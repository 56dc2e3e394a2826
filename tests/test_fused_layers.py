"""The compiled layer kernels (radixrt/kernels/fused_layers.py, csrc/fused_layers.c) against their torch
references, for every ISA variant this CPU can run (the test ids name it): the norms and rope
bit for bit in float32 and bfloat16 (the norms sum their squares in torch's order, which is
x86 torch's; elsewhere within 1e-5 relative or one bf16 ulp), act(gate) * up within 1e-5
relative in float32 and one ulp in bf16; odd hidden sizes (a partial last vector), batches of 1
and 64, partial rotary dims, q/k as views of a fused projection. Then the model: in float32 the
kernels it uses leave its numbers unchanged, in bf16 within a few roundings.
"""

from __future__ import annotations

import logging
import platform

import pytest
import torch
from radixrt.kernels import fused_layers
from radixrt.kernels.fused_layers import (
    KINDS, TORCH_LAYERS, act_mul_ref, add_rms_norm_ref, build_fused_layers, rms_norm_ref, rope_ref,
)  # fmt: skip
from radixrt.kernels.native_build import find_compiler, runnable_isas

ISAS = runnable_isas()
BATCHES = [1, 64]
HIDDEN = [576, 37]  # 37: not a multiple of any vector width
DTYPES = [torch.float32, torch.bfloat16]
TORCH_SUM_ORDER = platform.machine().lower() in ("x86_64", "amd64")  # torch_row_sum's order is x86 torch's


@pytest.fixture(scope="module", params=ISAS, ids=[f"isa={isa.name}" for isa in ISAS])
def fused(request) -> fused_layers.FusedLayers:
    """One variant, every kernel taking both dtypes (the model keeps float32's act_mul on torch)."""
    if find_compiler() is None:
        pytest.skip("no C compiler on this machine: the fused layer kernels cannot be built")
    return build_fused_layers(request.param, frozenset(KINDS), frozenset(KINDS))


def ordered(bits: torch.Tensor) -> torch.Tensor:
    """bf16 values -> int32 that count ulps (sign-magnitude to two's complement)."""
    u = bits.view(torch.int16).to(torch.int32) & 0xFFFF
    return torch.where(u >= 0x8000, -(u & 0x7FFF), u)


def assert_matches(got: torch.Tensor, want: torch.Tensor, atol: float = 0.0, exact: bool = False) -> None:
    """exact: bit for bit; else float32 within 1e-5 relative (plus atol), bf16 within one ulp (or atol)."""
    assert got.dtype == want.dtype and got.shape == want.shape
    if exact:
        assert torch.equal(got, want), f"{int((got != want).sum())} of {got.numel()} values differ"
        return
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol or 1e-7)
        return
    ulps = (ordered(got) - ordered(want)).abs()
    off = (ulps > 1) & ((got.float() - want.float()).abs() > atol)
    assert not off.any(), f"{int(off.sum())} values more than an ulp off, e.g. {got[off][:4]} vs {want[off][:4]}"


def inputs(T: int, hidden: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x, residual = (torch.randn(T, hidden, generator=g).to(dtype) for _ in range(2))
    weight = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    return x, residual, weight


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("T", BATCHES)
def test_rms_norm(fused, T, hidden, dtype, gemma):
    x, residual, weight = inputs(T, hidden, dtype, seed=T + hidden)
    got = fused.rms_norm(x, weight, 1e-6, gemma)
    assert_matches(got, rms_norm_ref(x, weight, 1e-6, gemma), exact=TORCH_SUM_ORDER)
    want_out, want_residual = add_rms_norm_ref(x, residual, weight, 1e-6, gemma)
    out, new_residual = fused.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6, gemma)
    assert torch.equal(new_residual, want_residual)  # one add, rounded once either way
    assert_matches(out, want_out, exact=TORCH_SUM_ORDER)


@pytest.mark.parametrize("hidden", [5, 4100])
def test_rms_norm_of_short_and_long_rows(fused, hidden):
    """Rows under 8 floats (torch sums them in scalar columns) and past 1024 (its cascade carries)."""
    x, _, weight = inputs(3, hidden, torch.float32, seed=hidden)
    assert_matches(fused.rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), exact=TORCH_SUM_ORDER)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_of_heads_in_a_fused_projection(fused, dtype):
    """Qwen3's q/k norm: [T, heads, head_dim] views whose token stride is the fused q/k/v row."""
    T, heads, kv_heads, head_dim = 5, 3, 1, 40
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q = qkv[:, : heads * head_dim].view(T, heads, head_dim)
    weight = (1 + 0.2 * torch.randn(head_dim)).to(dtype)
    assert_matches(fused.rms_norm(q, weight, 1e-6), rms_norm_ref(q, weight, 1e-6), exact=TORCH_SUM_ORDER)


@pytest.mark.parametrize("tables", ["float32", "model"], ids=lambda t: f"tables={t}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "head_dim,rotary_dim", [(64, 64), (40, 20), (80, 32)], ids=["full", "partial-odd-half", "partial"]
)
@pytest.mark.parametrize("T", BATCHES)
def test_rope(fused, T, head_dim, rotary_dim, dtype, tables):
    """Bit for bit in both dtypes: the same products and sums, rounded in the same places. The
    tables are float32, or in the model's dtype (model.to(bfloat16) rounds RotaryEmbedding's buffers)."""
    heads, kv_heads, table = 5, 2, 300
    qkv = torch.randn(T, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(T, heads, head_dim), k.view(T, kv_heads, head_dim)  # strided views, as the model has them
    angles = torch.outer(
        torch.arange(table, dtype=torch.float32), 1.0 / 1e4 ** (torch.arange(0, rotary_dim, 2) / rotary_dim)
    )
    emb = torch.cat([angles, angles], dim=-1)  # [table, rotary_dim]
    cos, sin = emb.cos() * 1.1, emb.sin() * 1.1  # an attention factor, as YaRN's
    if tables == "model":
        cos, sin = cos.to(dtype), sin.to(dtype)
    rows = torch.randint(0, table, (T,))
    (got_q, got_k), (want_q, want_k) = fused.rope(q, k, cos, sin, rows), rope_ref(q, k, cos, sin, rows)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)
    with pytest.raises(RuntimeError, match="out of range"):
        fused.rope(q, k, cos, sin, torch.full((T,), table))


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", [1536, 37])
@pytest.mark.parametrize("T", BATCHES)
def test_act_mul(fused, T, inter, dtype, act):
    gate_up = (1.5 * torch.randn(T, 2 * inter, generator=torch.Generator().manual_seed(inter))).to(dtype)
    # NOTE: tanh-GELU's 1 + tanh(u) cancels for gates below about -3, where torch's float32 result
    # keeps only ~1e-7 absolute precision (Sleef's tanh against ours): there the values are compared absolutely.
    atol = 2e-6 if act == "gelu_pytorch_tanh" else 0.0
    assert_matches(fused.act_mul(gate_up, act), act_mul_ref(gate_up, act), atol)


def test_what_the_kernels_do_not_take_runs_the_reference(fused):
    model_path = build_fused_layers(fused.isa)  # the model's: act_mul in bf16 only
    gate_up = torch.randn(4, 2 * 37)
    assert not model_path.act_dtypes & {torch.float32, torch.float16}
    assert torch.equal(model_path.act_mul(gate_up, "silu"), act_mul_ref(gate_up, "silu"))
    x32, _, w32 = inputs(4, 37, torch.float32, seed=1)
    x16, w16 = x32.half(), w32.half()
    assert torch.equal(fused.rms_norm(x16, w16, 1e-6), rms_norm_ref(x16, w16, 1e-6))  # float16: no kernel
    xb = x32.bfloat16()
    assert torch.equal(fused.rms_norm(xb, w32, 1e-6), rms_norm_ref(xb, w32, 1e-6))  # a weight of another dtype


def test_unbuildable_kernels_leave_the_torch_path_and_say_why(monkeypatch, caplog):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=fused_layers.__name__):
        assert fused_layers.load_fused_layers.__wrapped__() is None
    assert "unavailable" in caplog.text and "torch path" in caplog.text


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_model_on_the_kernels_computes_what_the_torch_path_does(llama_path, dtype):
    """The tiny llama as the runtime builds it (its kernels: norms and rope in float32, all in bf16)
    against the torch path: float32 logits bit for bit, so token parity with transformers stands
    as it did; bf16 within a few roundings, the same greedy tokens where they are not a coin toss."""
    from radixrt.kernels import AttentionMetadata, PagedKVCache
    from radixrt.kernels.torch_backend import TorchBackend
    from radixrt.models import ModelConfig, load_model
    from radixrt.models.llama import use_layer_ops

    if find_compiler() is None:
        pytest.skip("no C compiler on this machine")
    cfg = ModelConfig.from_dir(llama_path)
    model = load_model(llama_path, cfg, dtype, torch.device("cpu"))
    ids, n = torch.arange(20, 84), 64

    def logits(ops) -> torch.Tensor:
        use_layer_ops(model, ops)
        cache = PagedKVCache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"))
        attn = TorchBackend(cache, cfg.num_heads, cfg.head_dim, cfg.attention_layers(), native=False)
        attn.init_forward(AttentionMetadata([n], [n], torch.arange(8)[None], torch.arange(n), 16))
        with torch.inference_mode():
            return model.compute_logits(model(ids, torch.arange(n), attn))

    plain, fast = logits(TORCH_LAYERS), logits(build_fused_layers(ISAS[0]))
    if dtype == torch.float32 and TORCH_SUM_ORDER:
        assert torch.equal(fast, plain)
        return
    tol = 4 * 2**-8 * plain.abs().max().item()
    assert (fast - plain).abs().max().item() <= tol
    top2 = plain.topk(2, dim=-1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert torch.equal(fast.argmax(-1)[clear], plain.argmax(-1)[clear])

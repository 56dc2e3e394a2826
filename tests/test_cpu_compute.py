"""How a CPU worker computes: half-precision linears through float32 weights and through
oneDNN-packed weights (cpu_matmul.py), the allocator its process starts with (worker_env.py),
and the threads it takes.

The float32-weight path must still be the half model: its logits stay as close to
transformers' bf16 logits as the native bf16 path's are, the layers pass on bf16, and a tied
embedding keeps its dtype.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM
from radixrt.config import ServerArgs
from radixrt.kernels import AttentionMetadata, PagedKVCache
from radixrt.kernels.torch_backend import TorchBackend
from radixrt.models import ModelConfig, load_model
from radixrt.models import cpu_matmul
from radixrt.models.cpu_matmul import (
    choose_matmul_dtype,
    choose_weight_packing,
    hold_linear_weights_in,
    pack_linear_weights,
)
from radixrt.models.parallel import ColumnParallelLinear, RowParallelLinear, TPGroup
from radixrt.kernels.native_build import find_compiler
from radixrt.launch.worker_env import GLIBC_KEEP, worker_env
from radixrt.worker import runner_setup

PROMPT = list(range(20, 84))  # 64 tokens


def last_logits(model, cfg: ModelConfig, dtype: torch.dtype, native: bool = False) -> torch.Tensor:
    """The model's float32 logits at every position of PROMPT, prefilled in one chunk: through
    transformers' own attention op (sdpa: the torch path) unless native, so that a comparison
    with transformers' bf16 logits sees only what the test is about."""
    cache = PagedKVCache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"))
    attn = TorchBackend(cache, cfg.num_heads, cfg.head_dim, cfg.attention_layers(), native=native)
    n = len(PROMPT)
    attn.init_forward(AttentionMetadata([n], [n], torch.arange(8)[None], torch.arange(n), 16))
    with torch.inference_mode():
        hidden = model(torch.tensor(PROMPT), torch.arange(n), attn)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_float32_weights_keep_the_bf16_model(family, model_paths):
    path = model_paths[family]
    cfg = ModelConfig.from_dir(path)
    native = load_model(path, cfg, torch.bfloat16, torch.device("cpu"))
    upcast = load_model(path, cfg, torch.bfloat16, torch.device("cpu"))
    hold_linear_weights_in(upcast, torch.float32)
    linears = [m for m in upcast.modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
    assert linears and all(m.weight.dtype == torch.float32 for m in linears)
    assert upcast.embed_tokens.weight.dtype == torch.bfloat16  # tied or not, the embedding keeps its dtype
    assert upcast.layers[0].self_attn.qkv_proj(torch.ones(2, cfg.hidden_size, dtype=torch.bfloat16)).dtype == torch.bfloat16
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()(ids).logits[0].float()
    got_native, got_upcast = last_logits(native, cfg, torch.bfloat16), last_logits(upcast, cfg, torch.bfloat16)
    # A bf16 logit is good to about one rounding at its magnitude (2^-8 relative); the paths round
    # in different places (a half GEMM adds its bias after rounding), so allow a few roundings.
    tol = 4 * 2**-8 * reference.abs().max().item()
    for got in (got_native, got_upcast):
        assert (got - reference).abs().max().item() <= tol
        top2 = reference.topk(2, dim=-1).values
        clear = (top2[:, 0] - top2[:, 1]) > 2 * tol  # rows whose greedy token is not a bf16 coin toss
        assert clear.sum() >= len(PROMPT) // 4
        assert torch.equal(got.argmax(-1)[clear], reference.argmax(-1)[clear])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_compiled_attention_keeps_a_bf16_model_as_exact_as_transformers(family, model_paths):
    """Through the compiled kernel (float32 scores, softmax and sums over the bf16 pool) a bf16
    model's logits are no farther from the float32 model's than transformers' own bf16 logits
    are (they differ from those by up to a few bf16 roundings: each rounds elsewhere)."""
    if find_compiler() is None:
        pytest.skip("no C compiler on this machine: the compiled attention kernel cannot be built")
    path = model_paths[family]
    cfg = ModelConfig.from_dir(path)
    with torch.inference_mode():
        ids = torch.tensor([PROMPT])
        exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(ids).logits[0].float()
        theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()(ids).logits[0].float()
    ours = last_logits(load_model(path, cfg, torch.bfloat16, CPU), cfg, torch.bfloat16, native=True)
    assert (ours - exact).abs().mean() <= 1.1 * (theirs - exact).abs().mean()
    assert (ours - exact).abs().max() <= 1.1 * (theirs - exact).abs().max()


CPU = torch.device("cpu")
BF16_UNITS = frozenset({"avx2", "avx512f", "avx512_bf16"})
NO_UNITS = frozenset({"avx2", "fma"})


@pytest.mark.parametrize("flags,ratio,chosen", [
    (BF16_UNITS, 0.25, torch.bfloat16),  # units, and measured faster: bf16
    (BF16_UNITS, 1.5, torch.bfloat16),  # units, float32 a little faster: the flags hold
    (BF16_UNITS, 3.0, torch.float32),  # units that the measurement decisively contradicts
    (NO_UNITS, 6.0, torch.float32),  # no units (AVX2): float32
    (NO_UNITS, 0.8, torch.float32),  # no units, bf16 a little faster: the flags hold
    (NO_UNITS, 0.3, torch.bfloat16),  # decisively faster without the flags saying so
    (None, 1.2, torch.bfloat16),  # no flags to read: the measurement alone, MIN_SPEEDUP
    (None, 1.3, torch.float32),
])
def test_the_matmul_dtype_comes_from_the_flags_and_a_measurement_confirms_it(monkeypatch, flags, ratio, chosen):
    monkeypatch.setattr(cpu_matmul, "measure_matmul", lambda dtype: ratio)
    monkeypatch.setattr(cpu_matmul, "cpu_flags", lambda: flags)
    choice = choose_matmul_dtype(torch.bfloat16, CPU)
    assert choice.dtype == chosen and choice.reason
    assert choose_matmul_dtype(torch.bfloat16, CPU, "model").dtype == torch.bfloat16
    assert choose_matmul_dtype(torch.bfloat16, CPU, "float32").dtype == torch.float32
    assert choose_matmul_dtype(torch.float32, CPU).dtype == torch.float32
    assert choose_matmul_dtype(torch.bfloat16, torch.device("cuda")).dtype == torch.bfloat16


def packable(dtype: torch.dtype) -> bool:
    return choose_weight_packing(dtype, CPU).packed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_weights_compute_what_f_linear_does(dtype):
    """Both layer kinds, a bias, a batch of none, of one and of many rows, 3-d inputs, and a
    model-dtype input through float32-held weights: the packed product is F.linear's, to the
    summation order of another GEMM kernel."""
    if not packable(dtype):
        pytest.skip(f"oneDNN cannot pack {dtype} here: {choose_weight_packing(dtype, CPU).reason}")
    torch.manual_seed(0)
    column = ColumnParallelLinear(96, 80, bias=True).to(dtype)
    row = RowParallelLinear(80, 96, bias=True, tp=TPGroup())
    with torch.no_grad():
        row.weight.normal_(), row.bias.normal_()
    row.to(dtype)
    model = torch.nn.Sequential(column, row)
    inputs = [torch.randn(*shape, 96, dtype=dtype) for shape in ((0,), (1,), (37,), (3, 5))]
    with torch.inference_mode():
        plain = [model(x) for x in inputs]
        pack_linear_weights(model)
        assert column.packed is not None and row.packed is not None
        packed = [model(x) for x in inputs]
    tol = 1e-5 if dtype == torch.float32 else 2**-6
    for x, a, b in zip(inputs, plain, packed):
        assert b.shape == a.shape == (*x.shape[:-1], 96) and b.dtype == dtype
        assert torch.allclose(b.float(), a.float(), rtol=tol, atol=tol * max(a.float().abs().amax().item() if a.numel() else 0.0, 1.0))
    if packable(torch.float32):  # a bf16 model's layers held in float32 still pass bf16 on
        held = torch.nn.Sequential(ColumnParallelLinear(96, 80, bias=False).to(torch.bfloat16))
        hold_linear_weights_in(held, torch.float32)
        x = torch.randn(4, 96, dtype=torch.bfloat16)
        with torch.inference_mode():
            want = held(x)
            pack_linear_weights(held)
            got = held(x)
        assert got.dtype == torch.bfloat16 and (got.float() - want.float()).abs().max().item() <= 2**-7


def test_weight_packing_is_a_capability_asked_of_onednn(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "_cannot_pack", lambda dtype: None)
    assert choose_weight_packing(torch.float32, CPU).packed
    assert choose_weight_packing(torch.float32, CPU, "onednn").packed
    assert not choose_weight_packing(torch.float32, CPU, "none").packed
    assert not choose_weight_packing(torch.float32, torch.device("cuda")).packed
    why = "bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
    monkeypatch.setattr(cpu_matmul, "_cannot_pack", lambda dtype: why)
    choice = choose_weight_packing(torch.bfloat16, CPU)
    assert not choice.packed and why in choice.reason
    with pytest.raises(ValueError, match="cannot pack bfloat16 weights here: bf16 path needs"):
        choose_weight_packing(torch.bfloat16, CPU, "onednn")
    monkeypatch.undo()  # what oneDNN says of itself here: either way a reason, never an exception
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert choose_weight_packing(dtype, CPU).reason


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert cpu_matmul.cpu_flags(info) == {"fpu", "avx2", "avx512_bf16"}
    assert cpu_matmul.cpu_flags(tmp_path / "missing") is None


def test_the_measured_choice_does_not_flip_while_both_cores_are_busy():
    """The measurement alone (flags not read), 20 times while a burner spins on every core, gives
    what it gives on a quiet machine: the candidates are timed pair by pair, so load slows both."""
    quiet = {d: choose_matmul_dtype(d, CPU, use_flags=False).dtype for d in (torch.bfloat16, torch.float16)}
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)]
    try:
        loaded = [choose_matmul_dtype(d, CPU, use_flags=False).dtype for _ in range(10) for d in quiet]
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert loaded == [quiet[d] for _ in range(10) for d in quiet], (quiet, loaded)


def test_worker_env_prefers_tcmalloc_else_keeps_glibc_memory():
    env = worker_env({"PATH": "/bin"}, tcmalloc="/lib/libtcmalloc_minimal.so.4")
    assert env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4" and not set(GLIBC_KEEP) & set(env)
    env = worker_env({"PATH": "/bin", "LD_PRELOAD": "/lib/other.so"}, tcmalloc="/lib/libtcmalloc_minimal.so.4")
    assert env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4:/lib/other.so"
    env = worker_env({"PATH": "/bin", "MALLOC_TRIM_THRESHOLD_": "5"}, tcmalloc=None)
    assert env["MALLOC_TRIM_THRESHOLD_"] == "5"  # the user's setting stands
    assert env["MALLOC_MMAP_THRESHOLD_"] == GLIBC_KEEP["MALLOC_MMAP_THRESHOLD_"] and "LD_PRELOAD" not in env


def test_a_worker_takes_its_share_of_the_cores_it_may_run_on(monkeypatch):
    monkeypatch.setattr(runner_setup.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    assert runner_setup.cpu_threads(ServerArgs(model_path="m")) == 6
    assert runner_setup.cpu_threads(ServerArgs(model_path="m", tp_size=2)) == 3
    monkeypatch.setattr(runner_setup.os, "sched_getaffinity", lambda pid: {3})
    assert runner_setup.cpu_threads(ServerArgs(model_path="m", tp_size=2)) == 1

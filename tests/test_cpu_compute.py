"""How a CPU worker computes: half-precision linears through float32 weights (cpu_matmul.py),
the allocator its process starts with (worker_env.py), and the threads it takes.

The float32-weight path must still be the half model: its logits stay as close to
transformers' bf16 logits as the native bf16 path's are, the layers pass on bf16, and a tied
embedding keeps its dtype.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from radixrt.config import ServerArgs
from radixrt.kernels import AttentionMetadata, PagedKVCache
from radixrt.kernels.torch_backend import TorchBackend
from radixrt.models import ModelConfig, load_model
from radixrt.models import cpu_matmul
from radixrt.models.cpu_matmul import choose_matmul_dtype, hold_linear_weights_in
from radixrt.models.parallel import ColumnParallelLinear, RowParallelLinear
from radixrt.server.worker_env import GLIBC_KEEP, worker_env
from radixrt.worker import model_runner

PROMPT = list(range(20, 84))  # 64 tokens


def last_logits(model, cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    """The model's float32 logits at every position of PROMPT, prefilled in one chunk."""
    cache = PagedKVCache(cfg.num_layers, 8, 16, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"))
    attn = TorchBackend(cache, cfg.num_heads, cfg.head_dim, cfg.attention_layers())
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


def test_the_faster_matmul_is_chosen(monkeypatch):
    monkeypatch.setattr(cpu_matmul, "measure_matmul", lambda dtype: (6.0, 1.0))  # no half GEMM units
    assert choose_matmul_dtype(torch.bfloat16, torch.device("cpu")) == torch.float32
    monkeypatch.setattr(cpu_matmul, "measure_matmul", lambda dtype: (1.0, 1.1))  # native half GEMM
    assert choose_matmul_dtype(torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    assert choose_matmul_dtype(torch.float32, torch.device("cpu")) == torch.float32
    assert choose_matmul_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16


def test_worker_env_prefers_tcmalloc_else_keeps_glibc_memory():
    env = worker_env({"PATH": "/bin"}, tcmalloc="/lib/libtcmalloc_minimal.so.4")
    assert env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4" and not set(GLIBC_KEEP) & set(env)
    env = worker_env({"PATH": "/bin", "LD_PRELOAD": "/lib/other.so"}, tcmalloc="/lib/libtcmalloc_minimal.so.4")
    assert env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4:/lib/other.so"
    env = worker_env({"PATH": "/bin", "MALLOC_TRIM_THRESHOLD_": "5"}, tcmalloc=None)
    assert env["MALLOC_TRIM_THRESHOLD_"] == "5"  # the user's setting stands
    assert env["MALLOC_MMAP_THRESHOLD_"] == GLIBC_KEEP["MALLOC_MMAP_THRESHOLD_"] and "LD_PRELOAD" not in env


def test_a_worker_takes_its_share_of_the_cores_it_may_run_on(monkeypatch):
    monkeypatch.setattr(model_runner.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
    assert model_runner.cpu_threads(ServerArgs(model_path="m")) == 6
    assert model_runner.cpu_threads(ServerArgs(model_path="m", tp_size=2)) == 3
    monkeypatch.setattr(model_runner.os, "sched_getaffinity", lambda pid: {3})
    assert model_runner.cpu_threads(ServerArgs(model_path="m", tp_size=2)) == 1

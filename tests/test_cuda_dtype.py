"""A float32 checkpoint on CUDA: served in a dtype FlashInfer has kernels for, or refused at start by
name, never a KeyError out of FlashInfer's plan (its kernels exist for bfloat16 and float16 only).

dtype auto follows SGLang 0.5.9 (`_get_and_verify_dtype`): a float32 config is served in float16,
Gemma's in bfloat16. An explicit dtype float32 is served as asked, which on CUDA only the torch
attention backend can do; the flashinfer backend refuses it when the worker starts. Runs on the CPU:
the worker's CUDA start is traced on the meta device (tests/test_host_syncs.py).
"""

from __future__ import annotations

import pytest
import torch

from radixrt.kernels import LayerAttention, PagedKVCache
from radixrt.kernels import flashinfer_backend as fb
from radixrt.models.dtype import resolve_dtype
from support.meta_device import make_meta_runner

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize("config_dtype", ["float32", "float", "torch.float32", None])
@pytest.mark.parametrize("model_type,want", [("llama", "float16"), ("qwen2", "float16"), ("gemma2", "bfloat16")])
def test_float32_config_on_cuda_resolves_to_a_flashinfer_dtype(config_dtype, model_type, want):
    got = resolve_dtype(config_dtype, model_type, "cuda")
    assert got == want and DTYPES[got] in fb.Q_DTYPES
    assert resolve_dtype(config_dtype, model_type, "cpu") == "float32"  # the CPU keeps it (models/dtype.py says why)


def test_flashinfer_refuses_a_float32_pool_naming_the_dtype_and_the_ways_out():
    cache = PagedKVCache(1, 4, 16, 2, 64, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"dtype float32 is not supported by attention_backend 'flashinfer'.*"
                                         r"bfloat16, float16 or auto, or attention_backend 'torch'"):
        fb.FlashInferBackend(cache, 8, 64, [LayerAttention(0.125)])


def test_worker_start_on_cuda_with_dtype_float32_is_refused_by_name(llama_path, monkeypatch):
    with pytest.raises(ValueError, match="dtype float32 is not supported by attention_backend 'flashinfer'"):
        make_meta_runner(llama_path, monkeypatch, dtype="float32")


def test_worker_start_on_cuda_with_dtype_auto_serves_the_float32_tiny_llama_in_float16(llama_path, monkeypatch):
    from radixrt.worker import runner_setup

    # the meta device stands in for CUDA, so auto's rule is asked about "cuda"
    monkeypatch.setattr(runner_setup, "resolve_dtype", lambda c, m, device, r: resolve_dtype(c, m, "cuda", r))
    runner = make_meta_runner(llama_path, monkeypatch, dtype="auto")
    assert runner.cfg.torch_dtype in ("float32", None) and runner.dtype == torch.float16
    assert runner.cache.dtype == torch.float16

"""The layers of a model held quantized in one C call (radixrt/models/held_steps.py): the same hidden state and
the same KV pool, bit for bit, as the Python layers calling the same kernels one by one, for decodes and
prefill chunks in one step, in float32 and bf16; and the Python layers wherever the loop does not serve."""

from __future__ import annotations

import math

import pytest
import torch
from support.kernels import require_native
from test_gguf import tiny_gguf_sidecar

from radixrt.kernels import AttentionMetadata, PagedKVCache, create_attention_backend
from radixrt.models.config import ModelConfig
from radixrt.models.held_steps import HeldSteps
from radixrt.models.registry import load_model
from radixrt.settings.quant import WeightScheme

SIZES = {"hidden_size": 64, "intermediate_size": 128, "head_dim": 16, "num_hidden_layers": 2}
PAGE = 4


def held_model(tmp_path, arch: str, qtype: str, dtype: torch.dtype, sizes: dict | None = None):
    require_native()  # the held layers, their kernels and the loop are compiled C
    sidecar = tiny_gguf_sidecar(tmp_path, arch, {**SIZES, **(sizes or {})}, qtype)
    cfg = ModelConfig.from_dir(sidecar)
    return load_model(sidecar, cfg, dtype, torch.device("cpu"), scheme=WeightScheme("gguf", "test", prequantized=True)), cfg


def step(cfg: ModelConfig, shapes: list[tuple[int, int]], dtype: torch.dtype, kv_dtype: str = "auto"):
    """A backend over a pool whose cached prefixes are random, and the step's metadata: (prefix, new) per request."""
    cache = PagedKVCache(cfg.num_layers, 64, PAGE, cfg.num_kv_heads, cfg.head_dim, dtype, torch.device("cpu"), kv_dtype)
    g = torch.Generator().manual_seed(0)
    for buf in cache.k + cache.v:
        if buf.is_floating_point():
            buf.copy_(torch.randn(buf.shape, generator=g).to(dtype))
    backend = create_attention_backend("torch", cache, cfg.num_heads, cfg.head_dim, cfg.attention_layers())
    order, tables, at = torch.randperm(64, generator=g), [], 0
    for prefix, new in shapes:
        n = math.ceil((prefix + new) / PAGE)
        tables.append(order[at : at + n].tolist())
        at += n
    width = max(len(t) for t in tables)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    positions = torch.cat([torch.arange(p, p + n) for p, n in shapes])
    rows = torch.cat([torch.full((n,), i) for i, (_, n) in enumerate(shapes)])
    slots = table[rows, positions // PAGE] * PAGE + positions % PAGE
    meta = AttentionMetadata([n for _, n in shapes], [p + n for p, n in shapes], table, slots, PAGE)
    return backend, cache, meta, positions


def run(model, backend, meta, ids, positions, held: bool) -> torch.Tensor:
    """The step through the C loop (held: a Python layer called fails the test) or the Python layers."""
    keep = model.held_steps
    model.held_steps = keep if held else None
    if held:
        for layer in model.layers:
            layer.forward = lambda *a: pytest.fail("a Python layer ran where the C loop serves")
    try:
        with torch.inference_mode():
            backend.init_forward(meta)
            return model(ids, positions, backend)
    finally:
        model.held_steps = keep
        for layer in model.layers:
            layer.__dict__.pop("forward", None)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shapes", [[(9, 1)], [(5, 1), (13, 1), (0, 1), (7, 5)]], ids=["one", "mixed"])
def test_the_c_loop_gives_the_python_layers_hidden_state_and_pool(tmp_path, qtype, dtype, shapes):
    model, cfg = held_model(tmp_path, "llama", qtype, dtype)
    assert isinstance(model.held_steps, HeldSteps)
    T = sum(n for _, n in shapes)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(1))
    (b1, c1, meta, positions), (b2, c2, _, _) = step(cfg, shapes, dtype), step(cfg, shapes, dtype)
    got, want = run(model, b1, meta, ids, positions, True), run(model, b2, meta, ids, positions, False)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(c1.k + c1.v, c2.k + c2.v))


def test_where_the_loop_does_not_serve_the_python_layers_run(tmp_path):
    biased, _ = held_model(tmp_path, "qwen2", "Q8_0", torch.float32)
    assert biased.held_steps is None  # q/k/v biases: the loop has none
    model, cfg = held_model(tmp_path, "llama", "Q8_0", torch.float32)
    hs = model.held_steps
    ids = torch.tensor([3, 4])
    for kv_dtype in ("int8", "auto"):  # a quantized pool's layers store in Python; then too many rows
        backend, _, meta, positions = step(cfg, [(6, 2)], torch.float32, kv_dtype)
        if kv_dtype == "auto":
            hs.max_rows, hs.bound_to = 2, backend  # as if every layer's first route began at 2 rows
        with torch.inference_mode():
            backend.init_forward(meta)
            assert hs(model.embed(ids), positions, backend) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_loop_takes_each_layers_routes_below_its_first_dequantizing_one(tmp_path, dtype):
    """From a route's rows on, the loop multiplies through that route's tiles (the AMX-INT8 ones where the CPU
    has them, else the same VNNI ones: the choice is what is tested), as QuantLinear does, and the AMX-BF16 ones
    from 8 rows where the CPU has them; from a route that
    dequantizes the weight on, it leaves the step to the Python layers."""
    from radixrt.kernels.quant_weights import tile_kernels
    from radixrt.models.quant_linear import QuantLinear, Route

    model, cfg = held_model(tmp_path, "llama", "Q4_1", dtype)
    for m in model.modules():
        if isinstance(getattr(m, "quant", None), QuantLinear):
            q = m.quant
            others = tile_kernels()
            routes = [Route(4, others[0] if others else q.kernel)] + [Route(8, o) for o in others[1:2]]
            m.quant = QuantLinear(q.weight, q.kernel, routes + [Route(16, None)])
    shapes = [(5, 1), (13, 1), (0, 1), (7, 6)]  # 9 rows
    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(2))
    (b1, c1, meta, positions), (b2, c2, _, _) = step(cfg, shapes, dtype), step(cfg, shapes, dtype)
    assert torch.equal(run(model, b1, meta, ids, positions, True), run(model, b2, meta, ids, positions, False))
    assert all(torch.equal(a, b) for a, b in zip(c1.k + c1.v, c2.k + c2.v))
    assert model.held_steps.max_rows == 16

"""Weights held quantized (kernels/quant_weights.py, models/gguf_blocks.py): llama.cpp's blocks unpack to
exactly the weights gguf dequantizes (Q4_K to float16 scales), pack into the kernel's layout and back, and
every variant of the compiled GEMM equals its float64 reference on the weights held."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixrt.kernels.native_build import ISA_BY_NAME, runnable_isas
from radixrt.kernels.quant_weights import dequantize, pack, reference
from radixrt.models.gguf_blocks import BLOCK_BYTES, FITS, layer_format, unpack
from support.kernels import require_native

gguf = pytest.importorskip("gguf", reason="the gguf package (a dependency) is missing")
QTYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q6_K"]
K_QUANTS = {"Q4_K": slice(0, 4), "Q6_K": slice(208, 210)}  # where a block's float16 scales lie


def gguf_tensor(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """A tensor's raw bytes as a GGUF file holds them: quantized by gguf where it can, else (the K-quants)
    random blocks with finite float16 scales (any bytes are a valid block otherwise)."""
    rng = np.random.default_rng(seed)
    kind = gguf.GGMLQuantizationType[qtype]
    if qtype not in K_QUANTS:
        return gguf.quantize(rng.standard_normal((rows, cols)).astype(np.float32), kind)
    per, size = BLOCK_BYTES[qtype]
    blocks = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    at = K_QUANTS[qtype]
    blocks[:, at] = rng.uniform(1e-3, 1e-2, (len(blocks), (at.stop - at.start) // 2)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


HELD = [(qtype, fmt) for qtype in QTYPES for fmt in FITS[qtype]]  # each type in each format it fits


@pytest.mark.parametrize("qtype,fmt", HELD)
def test_gguf_blocks_unpack_to_the_weights_gguf_dequantizes(qtype, fmt):
    """In its own format and in every wider one a fused layer may hold it in (Q5_0 beside Q8_0 as int8)."""
    rows, cols = 48, 512
    raw = gguf_tensor(qtype, rows, cols)
    want = torch.from_numpy(gguf.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(rows, cols))
    w = pack(*unpack(raw, qtype, rows, cols, fmt))
    held = dequantize(w)
    per = {"q4s": 0.5625, "q4": 0.625, "q5s": 0.6875, "q5": 0.75, "q8": 1.0625, "q8_16": 1.125}[fmt]
    assert w.format.name == fmt and w.nbytes == rows * cols * per == rows * cols * w.format.nbytes_per_element
    if qtype == "Q4_K":  # scale and min rounded to float16: a relative 2^-11 of each at most
        torch.testing.assert_close(held, want, atol=16 * 2e-2 * 2**-11 * 64, rtol=0)
    elif qtype == "Q6_K":  # d sc rounded to float16 (|sc| <= 128, |n - 32| <= 32)
        torch.testing.assert_close(held, want, atol=1e-2 * 128 * 32 * 2**-11, rtol=0)
    else:
        assert torch.equal(held, want)


def test_a_type_is_held_only_in_the_formats_it_fits_exactly():
    layers = (["Q4_0"], ["Q4_0", "Q5_0"], ["Q5_0", "Q8_0"], ["Q4_1", "Q5_0"], ["Q6_K", "Q8_0"], ["Q4_1", "Q8_0"], ["F16"])
    assert [layer_format(set(t)) for t in layers] == ["q4s", "q5s", "q8", "q5", "q8_16", None, None]
    with pytest.raises(ValueError, match="Q4_1 is not held quantized as q8"):
        unpack(gguf_tensor("Q4_1", 16, 32), "Q4_1", 16, 32, "q8")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q8_0", "Q6_K"])
def test_an_embedding_held_in_the_tiles_looks_up_the_rows_they_hold(qtype):
    """A tied embedding held as the LM head's packed weight gives each id's row as `dequantize` holds it,
    rounded to the model's dtype once (as the embedding dequantized at load was)."""
    from radixrt.models.quant_linear import QuantRows

    n, k = 80, 256
    w = pack(*unpack(gguf_tensor(qtype, n, k), qtype, n, k))
    ids = torch.tensor([0, 17, 79, 17, 33, 15, 16])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(QuantRows(w, dtype)(ids), dequantize(w)[ids].to(dtype))


@pytest.mark.parametrize("group", [32, 128])
def test_int4wo_gives_each_group_its_own_sixteen_levels(group):
    """--torchao-config int4wo-<group>: one float16 scale and min per group along K (the last group shorter where K
    is not a multiple: 320 at 128), repeated over its groups of 32; every weight within half a step of its level,
    but for the float16 rounding of the scale and min."""
    from radixrt.models.int4_weights import quantize_int4

    w = torch.randn(32, 320, generator=torch.Generator().manual_seed(group)) * 0.05
    values, scales, mins = quantize_int4(w, group)
    assert values.dtype == torch.uint8 and int(values.max()) <= 15 and scales.shape == mins.shape == (32, 10)
    per = group // 32
    for first in range(0, 10, per):
        for t in (scales, mins):
            assert torch.equal(t[:, first:first + per], t[:, first:first + 1].expand(-1, min(per, 10 - first)))
    step = scales.float().repeat_interleave(32, dim=1)
    slack = 2**-10 * (mins.float().abs().repeat_interleave(32, dim=1) + 15 * step)
    assert ((dequantize(pack(values, scales, mins)) - w).abs() <= step / 2 + slack).all()
    assert int(values.min()) == 0 and int(values.max()) == 15  # each group's min and max are levels


def test_packing_refuses_shapes_the_kernel_cannot_tile():
    with pytest.raises(ValueError, match="multiple of 32"):
        pack(torch.zeros(16, 48, dtype=torch.int8), torch.ones(16, 1))
    with pytest.raises(ValueError, match="of 16"):
        pack(torch.zeros(24, 64, dtype=torch.int8), torch.ones(24, 2))


@pytest.mark.parametrize("isa", [isa.name for isa in runnable_isas() if isa.name != "brgemm"])
@pytest.mark.parametrize("qtype,fmt", HELD)
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_every_variant_equals_the_float64_reference(isa, qtype, fmt, rows, dtype):
    """y = x W^T over the held weights: activations quantized to int8 per 32 as the kernel does, products
    summed exactly, scaled in float32: to float32's rounding of the reference; a bf16 output is that float32
    product rounded to nearest even."""
    from radixrt.kernels.quant_weights import build_qgemm

    require_native()
    n, k = 96, 512
    w = pack(*unpack(gguf_tensor(qtype, n, k, seed=rows), qtype, n, k, fmt))
    x = (torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)) * 3).to(dtype)
    kernel = build_qgemm(ISA_BY_NAME[isa])
    got = kernel(x, w)
    want = reference(x, w)
    torch.testing.assert_close(got.double(), want, atol=1e-4 * want.abs().max().item(), rtol=1e-5)
    assert torch.equal(kernel(x, w, torch.bfloat16), got.bfloat16())


@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q8_0", "Q6_K"])
def test_from_each_route_s_rows_a_layer_goes_its_way(qtype):
    """Routes send a layer's product, from their row counts, through the AMX tiles or through its weight
    dequantized for the call: the compiled dequantizer gives `dequantize`'s values exactly (float32; bf16
    rounded to nearest even), and the layer's product is then F.linear over them; fewer rows take the ISA's
    tiles. The start-up choice makes routes at probed row counts, ascending, and logs every way's time."""
    from radixrt.kernels.quant_weights import load_amx_qgemm, load_qgemm, tile_kernels
    from radixrt.models.quant_linear import PROBE_ROWS, QuantLinear, Route, choose_routes

    require_native()
    kernel, amx = load_qgemm(), load_amx_qgemm()
    n, k = 64, 256
    w = pack(*unpack(gguf_tensor(qtype, n, k), qtype, n, k))
    assert torch.equal(kernel.dequantize(w, torch.float32), dequantize(w))
    assert torch.equal(kernel.dequantize(w, torch.bfloat16), dequantize(w).bfloat16())
    routes = [Route(4, amx), Route(8, None)] if amx else [Route(8, None)]
    layer = QuantLinear(w, kernel, routes)
    x = torch.randn(2, 4, k).bfloat16()
    assert torch.equal(layer(x), torch.nn.functional.linear(x, dequantize(w).bfloat16()))
    for few in (x[0, :3].float(), x[0].float()):  # the ISA's tiles; the AMX ones where the CPU has them
        want = reference(few, w)
        for tiles in (layer, QuantLinear(w, kernel)):
            torch.testing.assert_close(tiles(few).double(), want, atol=1e-4 * want.abs().max().item(), rtol=1e-5)
    few = x[:1, :3].float()  # [1, 3, k] goes through the reshapes, [3, k] straight to the bound tiles: equal
    assert torch.equal(layer(few)[0], layer(few[0]))
    with pytest.raises(ValueError, match=rf"\[M, {k}\] on the CPU, got torch.float32 \[1, {k + 32}\]"):
        kernel(torch.zeros(1, k + 32), w)
    chosen, timings = choose_routes(w, kernel, tile_kernels(), torch.bfloat16)
    assert [r.rows for r in chosen] == sorted(r.rows for r in chosen) and all(r.rows in PROBE_ROWS for r in chosen)
    assert all(f"{rows} rows {kernel.isa.name} 1.00x" in timings for rows in PROBE_ROWS) and "dequantized" in timings
    assert all(f" {other.name} " in timings for other in tile_kernels()) and (amx is not None) == (" amx " in timings)


def test_amx_tiles_equal_the_float64_reference_where_the_cpu_has_them():
    """qgemm.c's AMX-INT8 variant (16 rows a tile, rows past M padded) in every format, to float32's rounding."""
    from radixrt.kernels.native_build import AMX, cpu_flags
    from radixrt.kernels.quant_weights import load_amx_qgemm

    require_native()
    missing = AMX.needs - (cpu_flags() or frozenset())
    if missing:
        pytest.skip(f"the AMX-INT8 tiles need {', '.join(sorted(missing))}, which this CPU lacks")
    amx = load_amx_qgemm()
    assert amx is not None
    for qtype, fmt in HELD:
        for rows in (1, 16, 37):
            w = pack(*unpack(gguf_tensor(qtype, 96, 512, seed=rows), qtype, 96, 512, fmt))
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
            got, want = amx(x, w), reference(x, w)
            torch.testing.assert_close(got.double(), want, atol=1e-4 * want.abs().max().item(), rtol=1e-5)
            assert torch.equal(amx(x, w, torch.bfloat16), got.bfloat16())


def test_amx_bf16_tiles_equal_the_bf16_product_where_the_cpu_has_them():
    """amx_bf16_tiles.h: the weight dequantized to bf16 a tile at a time (exactly the dequantizer's bf16 values)
    times x rounded to bf16, summed in float32, in every format, rows past a block of 16 and of 64 padded, and
    from 128 rows two output tiles a pass (96 outputs: the last pass of a thread may hold one)."""
    from radixrt.kernels.native_build import AMX, cpu_flags
    from radixrt.kernels.quant_weights import load_amx_bf16_qgemm

    require_native()
    missing = AMX.needs - (cpu_flags() or frozenset())
    if missing:
        pytest.skip(f"the AMX-BF16 tiles need {', '.join(sorted(missing))}, which this CPU lacks")
    tiles = load_amx_bf16_qgemm()
    assert tiles is not None and tiles.name == "amx-bf16"
    for qtype, fmt in HELD:
        for rows in (1, 16, 37, 100, 130):
            w = pack(*unpack(gguf_tensor(qtype, 96 + 16 * (rows == 130), 512, seed=rows), qtype, 96 + 16 * (rows == 130),
                             512, fmt))  # 7 output tiles at 130 rows: a pair's odd one out
            x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)) * 3
            got = tiles(x, w)
            want = x.bfloat16().double() @ dequantize(w).bfloat16().double().T
            torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
            assert torch.equal(tiles(x.bfloat16(), w, torch.bfloat16), got.bfloat16())


def test_tensor_parallel_ranks_route_each_format_as_rank_0_measured():
    """Each process measures its routes at start, so two ranks may route a row count differently; agree_routes
    gives every held layer rank 0's (sent as a code per probed row count, Ranks.share) and leaves a rank that
    measured alike as it was. A format rank 0 does not hold, or AMX tiles this process lacks, are errors."""
    from radixrt.kernels.quant_weights import FORMATS, load_qgemm, tile_kernels
    from radixrt.models.quant_linear import PROBE_ROWS, QuantLinear, Route, agree_routes, route_codes, routes_from_codes

    require_native()
    kernel, others = load_qgemm(), tile_kernels()
    q4, q8 = (pack(*unpack(gguf_tensor(t, 32, 64), t, 32, 64)) for t in ("Q4_1", "Q8_0"))
    rank0 = [Route(64, None)]
    assert route_codes(rank0) == [0, 2, 2, 2] and routes_from_codes(route_codes(rank0), kernel, others) == rank0
    assert route_codes([]) == [0] * len(PROBE_ROWS) and routes_from_codes([0] * len(PROBE_ROWS), kernel, []) == []
    for other in others:  # each of this CPU's other tiles comes back as itself
        routed = [Route(16, other), Route(256, None)]
        assert routes_from_codes(route_codes(routed), kernel, others) == routed
    model = torch.nn.Sequential(torch.nn.Linear(1, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, 1))
    model[0].quant, model[1].quant = QuantLinear(q4, kernel, [Route(16, None)]), QuantLinear(q4, kernel, [Route(16, None)])
    model[2].quant = QuantLinear(q8, kernel, rank0)
    sent = []

    def share(values):  # rank 0 held both formats; its q4 layers go dequantized from 64 rows, its q8 as ours
        sent.append(values)
        codes = {"q4": route_codes(rank0), "q8": route_codes(rank0)}
        return [c for name in sorted(FORMATS) for c in codes.get(name, [-1] * len(PROBE_ROWS))]

    kept = model[2].quant
    assert agree_routes(model, share, others) == ["q4"]
    assert model[0].quant.routes == model[1].quant.routes == tuple(rank0) and model[2].quant is kept
    assert len(sent[0]) == len(PROBE_ROWS) * 6 and sent[0].count(-1) == len(PROBE_ROWS) * 4
    x = torch.randn(70, 64)
    assert torch.equal(model[0].quant(x), torch.nn.functional.linear(x, dequantize(q4)))
    with pytest.raises(RuntimeError, match="rank 0 holds no q8 layer where this rank does"):
        agree_routes(model, lambda v: [c if i < 4 * len(PROBE_ROWS) else -1 for i, c in enumerate(v)], others)
    with pytest.raises(RuntimeError, match="AMX-INT8 tiles, which this process cannot load"):
        routes_from_codes([0, 1, 1, 1], kernel, [])
    with pytest.raises(RuntimeError, match="AMX-BF16 tiles, which this process cannot load"):
        routes_from_codes([0, 3, 3, 2], kernel, [])

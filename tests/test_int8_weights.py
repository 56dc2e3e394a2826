"""Int8 weights (w8a8_int8, int8wo), compressed-tensors and fp8 checkpoints: every kernel against a
float64 reference of the same quantized arithmetic, the compiled passes bit for bit against torch,
the checkpoint configs radixrt runs or refuses, and end to end on tiny checkpoints: a
compressed-tensors checkpoint serves the tokens that quantizing at load serves. The real model's
agreement with its unquantized self is in test_real_model_quant.py."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from radixrt.kernels import native_build
from radixrt.kernels.int8_ops import build_int8_ops

from radixrt.models.checkpoint_quant import checkpoint_scheme, weight_scheme
from radixrt.models.fp8_checkpoint import dequantize_fp8
from radixrt.settings.quant import check_quantization_args
from radixrt.models.int8_linear import (
    CANDIDATES,
    INT8WO,
    KERNELS,
    SPLIT_ROWS,
    W8A8,
    Int8Choice,
    choose_int8_kernel,
    kernel_for,
    quantize_rows,
    quantize_tokens_ref,
    reference_int8wo,
    reference_w8a8,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_w8a8_checkpoint import make as make_w8a8
from make_w8a8_checkpoint import quantization_config

CPU = torch.device("cpu")
REFERENCES = {W8A8: reference_w8a8, INT8WO: reference_int8wo}


def _layer(rows: int, k: int, n: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, k, generator=g) * 2).to(dtype)
    q, scale = quantize_rows(torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g).to(dtype)
    return x, q, scale, bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scheme,kernel", [(s, k) for s, names in CANDIDATES.items() for k in names])
@pytest.mark.parametrize("rows", [1, 5, 40])
def test_each_kernel_computes_its_schemes_arithmetic(scheme, kernel, dtype, rows):
    """Against float64: float32 results within accumulation-order error, bf16 within one rounding."""
    x, q, scale, bias = _layer(rows, 96, 80, dtype)
    run = kernel_for(Int8Choice(scheme, kernel, ""), q, scale)
    for b in (None, bias):
        got, want = run(x, q, scale, b).double(), REFERENCES[scheme](x, q, scale, b).double()
        assert got.shape == want.shape == (rows, 80)
        tol = 2e-5 if dtype == torch.float32 else 2 ** -7
        assert torch.allclose(got, want, rtol=tol, atol=tol * want.abs().max().item()), (got - want).abs().max()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (scripts/gpu_check.sh runs it)")
@pytest.mark.parametrize("scheme", [W8A8, INT8WO])
def test_the_cuda_kernels_compute_the_same_arithmetic(scheme):
    x, q, scale, bias = (t.cuda() for t in _layer(5, 96, 80, torch.bfloat16))
    choice = choose_int8_kernel(scheme, torch.bfloat16, torch.device("cuda"))
    got = kernel_for(choice, q, scale)(x, q, scale, bias).double().cpu()
    want = REFERENCES[scheme](x.cpu(), q.cpu(), scale.cpu(), bias.cpu()).double()
    assert torch.allclose(got, want, rtol=2 ** -7, atol=2 ** -7 * want.abs().max().item())


def test_quantize_rows_is_symmetric_per_row_and_exact_on_int8_values():
    w = torch.tensor([[0.0, 0.0], [1.0, -2.0], [127.0, -127.0]])
    q, scale = quantize_rows(w)
    assert scale.shape == (3, 1) and scale[0].item() == 1.0  # an all-zero row
    assert q[1].tolist() == [64, -127] and scale[1].item() == pytest.approx(2 / 127)
    assert q[2].tolist() == [127, -127] and scale[2].item() == 1.0
    # a row split over ranks quantizes by the whole row's amax
    q_half, s_half = quantize_rows(w[1:, :1], amax=torch.tensor([[2.0], [127.0]]))
    assert torch.equal(q_half, q[1:, :1]) and torch.equal(s_half, scale[1:])


@pytest.mark.parametrize("isa", native_build.runnable_isas(), ids=lambda i: i.name)
def test_the_compiled_passes_equal_torch_bit_for_bit(isa):
    ops = build_int8_ops(isa)
    for dtype in (torch.float32, torch.bfloat16):
        for rows, k in ((1, 576), (9, 1536), (130, 600)):
            x, _, _, _ = _layer(rows, k, 8, dtype)
            x[0, :7] = 0
            if rows > 1:
                x[1] = 0  # a zero row: scale 1
            q, s = ops.quantize_tokens(x)
            q_ref, s_ref = quantize_tokens_ref(x)
            assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
            acc = torch.randint(-(2**20), 2**20, (rows, 33), dtype=torch.int32)
            sw, bias = torch.rand(33, 1), torch.randn(33).to(dtype)
            for b in (None, bias):
                want = acc.float().mul_(s).mul_(sw.view(1, -1))
                want = (want if b is None else want.add_(b.float())).to(dtype)
                assert torch.equal(ops.rescale(acc, s, sw, b, dtype), want)


def test_the_kernel_choice_names_the_int8_units_and_a_measurement():
    for scheme in (W8A8, INT8WO):
        choice = choose_int8_kernel(scheme, torch.bfloat16, CPU)
        assert choice.kernel in CANDIDATES[scheme] and choice.large in CANDIDATES[scheme]
        assert "CPU int8 units" in choice.reason and "1 rows:" in choice.reason and "64 rows:" in choice.reason


def test_a_split_choice_runs_each_kernel_on_its_calls(monkeypatch):
    ran = []
    for name in ("int8pack_mm", "upcast"):
        monkeypatch.setitem(KERNELS, name, lambda *a, name=name: ran.append(name))
    run = kernel_for(Int8Choice(INT8WO, "int8pack_mm", "", large="upcast"), *quantize_rows(torch.ones(4, 4)))
    for rows in (1, SPLIT_ROWS, SPLIT_ROWS + 1):
        run(torch.ones(rows, 4), None, None, None)
    assert ran == ["int8pack_mm", "int8pack_mm", "upcast"]


# ---- what checkpoints radixrt runs --------------------------------------------------------------


def test_compressed_tensors_int8_schemes_are_read_and_others_refused_by_name():
    assert checkpoint_scheme(quantization_config(weight_only=False)) == "w8a8_int8"
    assert checkpoint_scheme(quantization_config(weight_only=True)) == "int8wo"
    grouped = copy.deepcopy(quantization_config(False))
    grouped["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128)
    with pytest.raises(ValueError, match="per channel"):
        checkpoint_scheme(grouped)
    static = copy.deepcopy(quantization_config(False))
    static["config_groups"]["group_0"]["input_activations"].update(dynamic=False, strategy="tensor")
    with pytest.raises(ValueError, match="dynamic, per token"):
        checkpoint_scheme(static)
    packed = dict(quantization_config(False), format="pack-quantized")
    with pytest.raises(ValueError, match="format 'pack-quantized'"):
        checkpoint_scheme(packed)
    with pytest.raises(ValueError, match="quant_method 'awq'"):
        checkpoint_scheme({"quant_method": "awq", "bits": 4})
    with pytest.raises(ValueError, match="static activation scales"):
        checkpoint_scheme({"quant_method": "fp8", "activation_scheme": "static"})


def test_flags_and_checkpoint_must_agree():
    w8a8 = quantization_config(weight_only=False)
    assert weight_scheme(None, "", w8a8).prequantized
    assert weight_scheme("compressed-tensors", "", w8a8).name == "w8a8_int8"
    assert weight_scheme("w8a8_int8", "", w8a8).name == "w8a8_int8"
    with pytest.raises(ValueError, match="already quantized"):
        weight_scheme(None, "int8wo", w8a8)
    with pytest.raises(ValueError, match="no quantization_config"):
        weight_scheme("fp8", "", None)
    at_load = weight_scheme(None, "int8dq", None)
    assert (at_load.name, at_load.prequantized) == ("w8a8_int8", False)
    assert weight_scheme(None, "", None).name == "none"
    int4 = weight_scheme(None, "int4wo-64", None)
    assert (int4.name, int4.group, int4.prequantized) == ("int4wo", 64, False)
    check_quantization_args(None, "int4wo-256", "auto")
    with pytest.raises(ValueError, match=r"'int4wo-48' is not run by radixrt; it runs .*int4wo-32, int4wo-64"):
        check_quantization_args(None, "int4wo-48", "auto")


def test_int4wo_is_refused_where_its_tiles_do_not_run():
    from radixrt.models.int4_weights import quantize_layers

    with pytest.raises(ValueError, match=r"int4wo-128 holds the weights in radixrt's 4-bit CPU tiles; this server runs not on the CPU"):
        quantize_layers(torch.nn.Module(), 128, torch.device("meta"))


def test_int4wo_under_tensor_parallelism_quantizes_each_ranks_slice(llama_path):
    """--torchao-config int4wo-32 at --tp-size 2: each rank quantizes the slice it loaded, so at a group of 32
    (a row-parallel slice starts on a group) every rank holds exactly its slice of the one-rank layer."""
    from radixrt.kernels.quant_weights import dequantize
    from radixrt.models.config import ModelConfig
    from radixrt.models.parallel import TPGroup
    from radixrt.models.registry import load_model

    cfg, scheme = ModelConfig.from_dir(llama_path), weight_scheme(None, "int4wo-32", None)
    load = lambda tp: load_model(llama_path, cfg, torch.float32, torch.device("cpu"), tp, scheme)  # noqa: E731
    one, ranks = load(TPGroup()), [load(TPGroup(r, 2)) for r in range(2)]
    full = lambda model, name: dequantize(model.get_submodule(name).quant.weight)  # noqa: E731
    o, down, gate_up = "layers.1.self_attn.o_proj", "layers.1.mlp.down_proj", "layers.1.mlp.gate_up_proj"
    for r, part in enumerate(ranks):
        assert torch.equal(full(part, o), full(one, o)[:, r * 32:(r + 1) * 32])
        assert torch.equal(full(part, down), full(one, down)[:, r * 96:(r + 1) * 96])
        gu = full(one, gate_up)
        assert torch.equal(full(part, gate_up), torch.cat([gu[r * 96:(r + 1) * 96], gu[192 + r * 96:192 + (r + 1) * 96]]))
        assert part.quant_held[0] == one.quant_held[0] == 4 * cfg.num_layers


def test_fp8_weights_are_dequantized_per_tensor_per_row_and_per_block():
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(6, 8, generator=g)).to(torch.float8_e4m3fn)
    scales = {"a": torch.tensor(0.5), "b": torch.rand(6, 1, generator=g), "c": torch.rand(2, 3, generator=g)}
    tensors = [("model.norm.weight", torch.ones(8))]
    for name, s in scales.items():
        suffix = "weight_scale_inv" if name == "c" else "weight_scale"
        tensors += [(f"{name}.weight", w), (f"{name}.{suffix}", s), (f"{name}.input_scale", torch.tensor(1.0))]
    out = dict(dequantize_fp8(tensors, torch.float32))
    assert set(out) == {"model.norm.weight", "a.weight", "b.weight", "c.weight"}
    assert torch.equal(out["a.weight"], w.float() * 0.5)
    assert torch.equal(out["b.weight"], w.float() * scales["b"])
    block = scales["c"].repeat_interleave(3, 0).repeat_interleave(3, 1)[:, :8]  # blocks of 3 x 3
    assert torch.equal(out["c.weight"], w.float() * block)
    with pytest.raises(ValueError, match="lack their weight or its scale"):
        list(dequantize_fp8([("d.weight", w)], torch.float32))


# ---- end to end on a tiny checkpoint ---------------------------------------------------------------


@pytest.fixture(scope="module")
def w8a8_checkpoint(llama_path, tmp_path_factory) -> Path:
    return make_w8a8(llama_path, tmp_path_factory.mktemp("w8a8") / "llama-w8a8")


def test_a_compressed_tensors_checkpoint_serves_what_quantizing_at_load_serves(llama_path, w8a8_checkpoint):
    from support.helpers import assert_no_page_leak

    import radixrt

    prompts = ["The quick brown fox", "Once upon a time there was"]
    params = {"max_new_tokens": 12, "temperature": 0}
    served = {}
    for name, kw in {"at load": {"model_path": str(llama_path), "quantization": "w8a8_int8"},
                     "checkpoint": {"model_path": str(w8a8_checkpoint)}}.items():
        with radixrt.Engine(max_total_tokens=1024, dtype="float32", log_level="warning", **kw) as engine:
            served[name] = [o["output_ids"] for o in engine.generate(prompts, sampling_params=params)]
            info = engine.get_server_info()
            assert info["weight_quantization"] == "w8a8_int8"
            success, message, _ = engine.update_weights_from_disk(kw["model_path"])  # not in place on int8
            assert not success and "served quantized (w8a8_int8)" in message
            assert_no_page_leak(engine)
    assert "compressed-tensors" in info["weight_quantization_reason"]
    assert served["at load"] == served["checkpoint"]
    assert all(len(ids) == 12 for ids in served["checkpoint"])


def test_int4wo_serves_from_four_bit_tiles(llama_path):
    """--torchao-config int4wo-32 on an unquantized checkpoint: every projection held in 4-bit tiles, the
    server says so, requests complete with no page leaked, and weights are not updated in place. At
    --tp-size 2 (each rank its slice, quantized alike at a group of 32) the greedy tokens are one rank's."""
    from support.helpers import assert_no_page_leak

    import radixrt

    served = []
    for tp in (1, 2):
        with radixrt.Engine(model_path=str(llama_path), torchao_config="int4wo-32", max_total_tokens=512, dtype="float32",
                            tp_size=tp, log_level="warning") as engine:
            outs = engine.generate(["The quick brown fox", "Once upon a time"], sampling_params={"max_new_tokens": 6, "temperature": 0})
            served.append([o["output_ids"] for o in outs])
            assert all(len(ids) == 6 for ids in served[-1])
            info = engine.get_server_info()
            assert info["weight_quantization"] == "int4wo"
            assert "16 linear layers held in 4 bits per 32 inputs" in info["weight_quantization_reason"]
            success, message, _ = engine.update_weights_from_disk(str(llama_path))
            assert not success and "served quantized (int4wo)" in message
            assert_no_page_leak(engine)
    assert served[0] == served[1]


def test_an_fp8_checkpoint_loads_as_its_dequantized_weights(llama_path, tmp_path):
    """Every linear weight stored as fp8 e4m3 with a per-row scale (input scales beside, dropped):
    the model holds weight * scale, as a float checkpoint of those values loads."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from radixrt.models import ModelConfig, load_model

    fp8_dir, float_dir = tmp_path / "fp8", tmp_path / "float"
    for d in (fp8_dir, float_dir):
        shutil.copytree(llama_path, d)
        (d / "model.safetensors").unlink()
    stored, dequantized = {}, {}
    for name, t in load_file(str(llama_path / "model.safetensors")).items():
        if name.endswith("_proj.weight"):
            scale = t.float().abs().amax(1, keepdim=True) / 448
            w8 = (t.float() / scale).to(torch.float8_e4m3fn)
            stored.update({name: w8, name + "_scale": scale, name.replace(".weight", ".input_scale"): torch.ones(())})
            dequantized[name] = w8.float() * scale
        else:
            stored[name] = dequantized[name] = t
    save_file(stored, str(fp8_dir / "model.safetensors"))
    save_file(dequantized, str(float_dir / "model.safetensors"))
    cfg_file = fp8_dir / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()),
                                    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic"}}))
    scheme = weight_scheme(None, "", ModelConfig.from_dir(fp8_dir).raw["quantization_config"])
    assert (scheme.name, scheme.prequantized) == ("fp8", True)
    loaded = load_model(fp8_dir, ModelConfig.from_dir(fp8_dir), torch.float32, CPU, scheme=scheme).state_dict()
    want = load_model(float_dir, ModelConfig.from_dir(float_dir), torch.float32, CPU).state_dict()
    assert loaded.keys() == want.keys() and all(torch.equal(loaded[k], want[k]) for k in want)

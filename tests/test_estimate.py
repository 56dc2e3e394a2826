"""`radixrt estimate` (radixrt/ops/estimate.py): its figures against what a running engine allocated,
its refusal of a directory that is not a checkpoint, and its fit logic on numbers worked out by hand."""

from __future__ import annotations

import json

import pytest
import radixrt
import torch
from transformers import AutoTokenizer
from radixrt.config import ServerArgs
from radixrt.models.config import ModelConfig
from radixrt.ops.estimate import estimate, main, trace_avg_seq_len
from radixrt.ops.sizing import Sizer, Workload
from radixrt.utils.checkpoint_meta import TensorMeta

AVG_SEQ_LEN = 100
# dtype, kv dtype and tp vary; the pool is fixed by max_total_tokens, as the comparison needs
CONFIGS = {
    "float32-auto-tp1": dict(dtype="float32", kv_cache_dtype="auto", tp_size=1, page_size=1, max_total_tokens=2048),
    "bfloat16-int8-tp1": dict(dtype="bfloat16", kv_cache_dtype="int8", tp_size=1, page_size=16, max_total_tokens=4096,
                              max_running_requests=64),
    "float32-fp8_e4m3-tp2": dict(dtype="float32", kv_cache_dtype="fp8_e4m3", tp_size=2, page_size=4,
                                 max_total_tokens=2048, context_length=2048),
    # int4 groups a head's elements by 32: qwen3's heads (32 wide), not llama-tiny's (16)
    "bfloat16-int4-tp1": dict(dtype="bfloat16", kv_cache_dtype="int4", tp_size=1, page_size=16, max_total_tokens=4096),
    "float32-int8:int4-tp1": dict(dtype="float32", kv_cache_dtype="int8:int4", tp_size=1, page_size=16,
                                  max_total_tokens=2048),
}  # fmt: skip


def cli_argv(model_path: str, kw: dict) -> list[str]:
    flags = [a for k, v in kw.items() for a in ("--" + k.replace("_", "-"), str(v))]
    workload = ["--avg-seq-len", str(AVG_SEQ_LEN), "--mem-gb", "1"]
    return ["--model-path", model_path, "--device", "cpu", *flags, *workload, "--json"]


@pytest.mark.parametrize("config", CONFIGS)
def test_estimate_matches_the_allocated_pool(llama_path, config, capsys, tmp_path):
    kw = CONFIGS[config]
    path = llama_path
    if "int4" in kw["kv_cache_dtype"]:
        from make_family_models import ensure_family_model

        path = ensure_family_model("qwen3")
    est = estimate(ServerArgs(model_path=str(path), device="cpu", **kw), Workload(AVG_SEQ_LEN), mem_bytes=1 << 30)
    assert main(cli_argv(str(path), kw)) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == est.to_json()
    # The quantized pools' start-up check: its floor is off (random weights' near-tied logits flip
    # under quantized KV), and one short prompt instead of the built-ins keeps the start cheap.
    calibration = tmp_path / "calibration.txt"
    calibration.write_text("The cat sat on the mat.")
    check = dict(kv_quant_min_agreement=0, kv_calibration_file=str(calibration))
    with radixrt.Engine(model_path=str(path), device="cpu", log_level="warning", **check, **kw) as engine:
        info = engine.get_server_info()
    for key in ("bytes_per_token", "num_pages", "page_size"):
        assert printed[key] == info[key], key
    real = info["kv_pool_bytes"] + info["page_table_bytes"]
    assert abs(printed["kv_pool_bytes"] + printed["page_table_bytes"] - real) <= 0.02 * real
    if kw["dtype"] == "float32":  # a half model's CPU linears may be held in float32 (cpu_matmul.py)
        assert abs(printed["weight_bytes"] - info["weight_bytes"]) <= 0.02 * info["weight_bytes"]
    assert printed["requests_in_pool"] == info["num_pages"] // -(-AVG_SEQ_LEN // kw["page_size"])


def test_refuses_a_kv_dtype_the_model_cannot_take_by_name(llama_path):
    args = ServerArgs(model_path=str(llama_path), device="cpu", kv_cache_dtype="int4")  # llama-tiny: heads 16 wide
    with pytest.raises(ValueError, match="int4 needs head_dim a multiple of 32, not 16"):
        estimate(args, Workload(AVG_SEQ_LEN), mem_bytes=1 << 30)


def test_refuses_a_directory_without_config_json(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--model-path", str(tmp_path), "--avg-seq-len", "10"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "config.json" in err and err.count("\n") == 1


def test_trace_average(llama_path, tmp_path):
    """The trace is radixrt tune's: token ids count as they are, text as the server tokenizes it."""
    trace = tmp_path / "trace.jsonl"
    lines = [{"arrival": 0, "input_ids": [1, 2, 3], "output_len": 2}, {"arrival": 1, "prompt": "hello", "output_len": 1}]
    trace.write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    text = len(AutoTokenizer.from_pretrained(llama_path).encode("hello", add_special_tokens=True))
    assert trace_avg_seq_len(trace, str(llama_path)) == pytest.approx((3 + 2 + text + 1) / 2)
    trace.write_text('{"arrival": 0, "output_len": 3}\n')
    with pytest.raises(ValueError, match="trace.jsonl line 1"):
        trace_avg_seq_len(trace, str(llama_path))


# -- the fit logic, by hand ----------------------------------------------------------------------

# 1 layer, 2 of 4 heads KV, head_dim 8; float32: K+V of a token take 2 * 2 * 8 * 4 = 128 bytes (tp 1)
CFG = ModelConfig(model_type="llama", vocab_size=16, hidden_size=32, intermediate_size=64, num_layers=1,
                  num_heads=4, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=15,
                  rope_theta=1e4)  # fmt: skip
# weights: 4_000_000 bytes split over tp + 4_000 replicated; activation reserve 12% of them
TENSORS = {
    "model.layers.0.mlp.down_proj.weight": TensorMeta("F32", (1000, 1000)),
    "model.norm.weight": TensorMeta("F32", (1000,)),
}


def sizer(mem_bytes: int, device: str = "cuda") -> Sizer:
    return Sizer(CFG, TENSORS, torch.float32, device, page_size=1, context_length=15, mem_bytes=mem_bytes)


def test_fit_logic_by_hand():
    # avg 10 tokens: 12 pages a request with the margin; a page-table row is (15 + 1) * 8 = 128 bytes.
    w = Workload(10)
    assert (w.pages(100, 1), w.pages(3, 4), w.requests_in(25, 1)) == (1200, 11, 2)
    # tp 1, c requests: 4_004_000 + 480_480 + pool (12c + 1) * bytes/token + table 128c
    b = sizer(0).breakdown(1, "auto", 100, w.pages(100, 1))
    parts = (b.weight_bytes, b.activation_bytes, b.kv_pool_bytes, b.page_table_bytes)
    assert parts == (4_004_000, 480_480, 1201 * 128, 100 * 128)
    mem = 4_484_608 + 1664 * 100  # auto: 4_484_608 + 1664c, so exactly 100 requests fit
    s = sizer(mem)
    assert s.max_concurrency(1, "auto", w) == 100
    assert s.max_concurrency(1, "int8", w) == (mem - 4_484_528) // 704  # 48 B/token: 4_484_528 + 704c
    assert s.max_concurrency(1, "fp8_e4m3", w) == (mem - 4_484_512) // 512  # 32 B/token: 4_484_512 + 512c
    assert sizer(4_484_000).max_concurrency(1, "auto", w) == 0  # the weights and reserve alone do not fit
    # tp 2: 2_004_000 + 240_480 + pool 1201 * 64 (one KV head) + table 12_800 = 2_334_144 per GPU
    assert sizer(3_000_000).min_tp_size("auto", 100, 1200) == 2
    assert sizer(2_334_143).min_tp_size("auto", 100, 1200) == 4  # tp 3 does not split 4 heads
    # CPU ranks share one memory: tp 2 needs 2 x 2_334_144, tp 4 4 x 1_214_144 (KV heads replicated)
    assert sizer(3_000_000, "cpu").min_tp_size("auto", 100, 1200) is None

"""SGLang 0.5.9's own load generator, `python -m sglang.bench_serving --backend sglang`, runs
against radixrt unchanged: its warm-up and every request succeed (it sends SGLang-only fields such
as return_routed_experts and lora_path at their defaults, and streams /generate)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path


NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 8, 32, 8
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}  # the tiny model dir only


def test_sglang_bench_serving_completes_every_request(server, llama_path, tmp_path: Path):
    importlib.import_module("sglang.bench_serving")  # its imports come with the dev extra: a failure, not a skip
    out_file = tmp_path / "bench.jsonl"
    host, port = server.removeprefix("http://").rsplit(":", 1)
    cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--host", host, "--port", port,
           "--model", str(llama_path), "--tokenizer", str(llama_path), "--dataset-name", "random-ids",
           "--num-prompts", str(NUM_PROMPTS), "--random-input-len", str(INPUT_LEN), "--random-output-len",
           str(OUTPUT_LEN), "--random-range-ratio", "1", "--output-file", str(out_file), "--output-details",
           "--disable-tqdm"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=tmp_path, env={**os.environ, **OFFLINE})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "Warmup completed" in run.stdout, run.stdout[-3000:]
    result = json.loads(out_file.read_text().splitlines()[-1])
    assert result["completed"] == NUM_PROMPTS and not any(result["errors"]), result["errors"]
    # ignore_eos (bench_serving's default): every request generates exactly what it asked for
    assert result["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert result["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN

"""On a CUDA GPU: the whole engine with each attention backend against transformers' fp32
logprobs on the same weights. Skips, saying why, without a GPU (or without flashinfer).

The 100M model (head_dim 64) is used: FlashInfer's kernels want head_dim 64/128/256, and
the tiny models' is 16. bf16 on the GPU against an fp32 reference: logprobs agree to about
0.1, while a wrong mask or page mapping is off by whole nats.
"""

from __future__ import annotations

import pytest
import radixrt
import torch
from helpers import corpus_prompts, hf_logprobs
from make_tiny_model import ensure_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; none is present")


@pytest.mark.parametrize("backend", ["flashinfer", "torch"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_on_cuda_matches_transformers_logprobs(backend, page_size, llama_path):
    if backend == "flashinfer":
        pytest.importorskip("flashinfer", reason="flashinfer-python (the `cuda` extra) is not installed")
    path = ensure_model("llama", "100m")
    prompts = corpus_prompts(llama_path, [40, 150, 300], seed=31)  # token ids < 1024 fit its vocabulary
    with radixrt.Engine(model_path=str(path), dtype="bfloat16", device="cuda", attention_backend=backend,
                        page_size=page_size, chunked_prefill_size=64, max_total_tokens=8192) as engine:
        results = engine.generate(input_ids=prompts, sampling_params={"max_new_tokens": 8, "temperature": 0},
                                  return_logprob=True, logprob_start_len=0)
        info = engine.get_server_info()
        assert info["free_pages"] + info["cached_pages"] == info["num_pages"]
    for ids, res in zip(prompts, results):
        out = res["output_ids"]
        ref = hf_logprobs(path, ids + out)  # fp32 on the CPU
        got = [t[0] for t in res["meta_info"]["input_token_logprobs"][1:]] + [t[0] for t in res["meta_info"]["output_token_logprobs"]]
        want = [ref[j - 1, (ids + out)[j]].item() for j in range(1, len(ids) + len(out))]
        diffs = [abs(a - b) for a, b in zip(got, want)]
        assert max(diffs) < 0.25 and sum(diffs) / len(diffs) < 0.05, (max(diffs), sum(diffs) / len(diffs))

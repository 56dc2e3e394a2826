"""Int8 weights on the real model (SmolLM2-135M-Instruct, in float32): teacher-forced over the
quantized-KV check's calibration prompts (prose, a number table, code), the top token of
w8a8_int8 and int8wo agrees with the unquantized model's at least as often as the agreement
floor that radixrt holds quantized KV to (settings.kv.KV_QUANT_MIN_AGREEMENT). In process: loading
the model three times costs seconds, three engines would cost tens."""

from __future__ import annotations

import pytest
import torch
from radixrt.kernels import PagedKVCache, create_attention_backend

from radixrt.settings.kv import KV_QUANT_MIN_AGREEMENT
from radixrt.models import ModelConfig, load_model
from radixrt.models.int8_linear import choose_int8_kernel
from radixrt.models.weight_quant import use_int8_kernel
from radixrt.models.checkpoint_quant import weight_scheme
from radixrt.settings.quant import WeightScheme
from radixrt.worker.kv_calibration import (
    calibration_prompts,
    compare_logits,
    teacher_forced_logits,
)

CPU = torch.device("cpu")
PROMPT_TOKENS = 160  # of each calibration prompt: about 480 positions in all, a few seconds a model


@pytest.fixture(scope="module")
def real(smollm2):
    from transformers import AutoTokenizer

    cfg = ModelConfig.from_dir(smollm2.hf_dir)
    prompts = [p[:PROMPT_TOKENS] for p in calibration_prompts(AutoTokenizer.from_pretrained(smollm2.hf_dir), None)]
    pages = len(prompts) * max(map(len, prompts))  # one page per token, each prompt on its own pages
    cache = PagedKVCache(cfg.num_layers, pages, 1, cfg.num_kv_heads, cfg.head_dim, torch.float32, CPU)
    attn = create_attention_backend("torch", cache, cfg.num_heads, cfg.head_dim, cfg.attention_layers())

    def logits(scheme: WeightScheme) -> list[torch.Tensor]:
        model = load_model(smollm2.hf_dir, cfg, torch.float32, CPU, scheme=scheme)
        if scheme.name == "int4wo":  # every projection of the 30 layers, K = 576 at group 128 included (a shorter last group)
            assert model.quant_held[0] == 4 * cfg.num_layers
        if scheme.int8:
            use_int8_kernel(model, choose_int8_kernel(scheme.name, torch.float32, CPU))
        return teacher_forced_logits(model, attn, prompts)

    return logits, logits(WeightScheme("none", "unquantized"))


@pytest.mark.parametrize("scheme", ["w8a8_int8", "int8wo"])
def test_int8_weights_agree_with_the_unquantized_real_model(real, scheme):
    logits, reference = real
    report = compare_logits(torch.cat(reference), torch.cat(logits(WeightScheme(scheme, "test"))))
    print(f"smollm2 fp32 {scheme}: {report}")
    assert report.positions > 300
    assert report.top1_agreement >= KV_QUANT_MIN_AGREEMENT, report


# --torchao-config int4wo-<group>, measured top-1 agreement on these positions: group 32 0.978, group 128 0.740 (the
# floors sit a little under). This checkpoint's weights are the Q4_1 file's values (scripts/make_smollm2.py), 4-bit
# levels per 32 already: at group 32 the min-max grid finds them again, so it agrees as int8wo does; group 128's
# coarser grid is 4 bits' real cost.
INT4WO_AGREEMENT = {"int4wo-32": 0.95, "int4wo-128": 0.70}


@pytest.mark.parametrize("config", sorted(INT4WO_AGREEMENT))
def test_int4wo_holds_every_projection_in_four_bits_and_agrees_as_measured(real, config):
    logits, reference = real
    scheme = weight_scheme(None, config, None)
    report = compare_logits(torch.cat(reference), torch.cat(logits(scheme)))
    print(f"smollm2 fp32 {config}: {report}")
    assert report.top1_agreement >= INT4WO_AGREEMENT[config], report

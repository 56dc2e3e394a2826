"""What a checkpoint's quantization_config says, and with the flags, which WeightScheme a model runs.

A config.json may carry `quantization_config` (as SGLang and vLLM read it):
  * quant_method "compressed-tensors" (llm-compressor's format), read through the
    `compressed-tensors` package. radixrt runs its int8 schemes with symmetric per-channel
    weights: W8A8 (input activations int8, symmetric, dynamic, per token: our w8a8_int8) and
    W8A16 per channel (no input activations: our int8wo). Tensors: `weight` int8 [out, in] and
    `weight_scale` [out, 1]. Anything else (group or block weights, static or asymmetric
    activations, float formats, packed 4-bit) is refused by name.
  * quant_method "w8a8_int8" (SGLang's own pre-quantized layout): the same tensors, w8a8_int8.
  * quant_method "fp8" (fp8 e4m3 `weight` with `weight_scale`, or block-wise `weight_scale_inv`):
    dequantized at load (fp8_checkpoint.py).
--quantization must agree with what the checkpoint holds (SGLang's rule: a pre-quantized
checkpoint needs no flag); on an unquantized checkpoint, w8a8_int8 and --torchao-config
quantize at load.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from radixrt.settings.quant import TORCHAO_SCHEMES, WeightScheme

INT8_FORMATS = ("int-quantized", "naive-quantized")


def checkpoint_scheme(qc: Mapping[str, Any] | None) -> str | None:
    """The scheme a quantization_config's tensors hold ("w8a8_int8", "int8wo", "fp8"), or None
    for none. Raises ValueError naming what radixrt does not run."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors_scheme(qc)
    if method == "w8a8_int8":
        return "w8a8_int8"
    if method == "fp8":
        if qc.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("config.json's fp8 quantization_config has static activation scales; radixrt "
                             "dequantizes fp8 weights at load and runs activations unquantized, so it needs "
                             "activation_scheme dynamic")
        return "fp8"
    raise ValueError(f"config.json's quantization_config has quant_method {method!r}, which radixrt does not run "
                     "(it runs compressed-tensors int8 W8A8/W8A16, w8a8_int8 and fp8)")


def _compressed_tensors_scheme(qc: Mapping[str, Any]) -> str:
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig.model_validate(dict(qc))
    what = "config.json's compressed-tensors quantization_config"
    if config.format not in INT8_FORMATS:
        raise ValueError(f"{what} has format {config.format!r}; radixrt runs {', '.join(INT8_FORMATS)} (int8)")
    if any(name != "lm_head" for name in config.ignore or ()):
        raise ValueError(f"{what} leaves {config.ignore} unquantized; radixrt quantizes every linear layer but lm_head")
    schemes = set()
    for name, group in config.config_groups.items():
        w, a = group.weights, group.input_activations
        if w is None or (w.num_bits, str(w.type), w.symmetric, str(w.strategy)) != (8, "int", True, "channel"):
            raise ValueError(f"{what}: group {name!r} weights are {w}; radixrt runs 8-bit symmetric int per channel")
        if a is not None and ((a.num_bits, str(a.type), a.symmetric, a.dynamic, str(a.strategy))
                              != (8, "int", True, True, "token")):  # fmt: skip
            raise ValueError(f"{what}: group {name!r} input activations are {a}; radixrt runs 8-bit symmetric int, "
                             "dynamic, per token (or none: weight-only)")
        schemes.add("int8wo" if a is None else "w8a8_int8")
    if len(schemes) != 1:
        raise ValueError(f"{what} mixes schemes {sorted(schemes)} across groups; radixrt runs one")
    return schemes.pop()


def weight_scheme(quantization: str | None, torchao_config: str, qc: Mapping[str, Any] | None) -> WeightScheme:
    """The scheme the model runs: what the checkpoint holds (prequantized), or what the flags ask
    of an unquantized checkpoint. Raises ValueError when they disagree."""
    held = checkpoint_scheme(qc)
    if held is not None:
        agree = {None, "compressed-tensors" if qc and qc.get("quant_method") == "compressed-tensors" else held}
        if held == "w8a8_int8":
            agree.add("w8a8_int8")  # the same arithmetic, as SGLang lets w8a8_int8 read such checkpoints
        if quantization not in agree or torchao_config:
            asked = quantization or f"torchao_config {torchao_config}"
            raise ValueError(f"the checkpoint is already quantized ({held}, quant_method "
                             f"{qc.get('quant_method')!r}); {asked} asks for another quantization: drop the flag")
        return WeightScheme(held, f"the checkpoint's quantization_config ({qc.get('quant_method')})", prequantized=True)
    if quantization in ("compressed-tensors", "fp8"):
        raise ValueError(f"quantization {quantization} loads pre-quantized checkpoints, and config.json has no "
                         "quantization_config (to quantize at load, use w8a8_int8 or --torchao-config int8wo)")
    if quantization == "w8a8_int8":
        return WeightScheme("w8a8_int8", "--quantization w8a8_int8, quantized at load")
    if quantization == "gguf" and not torchao_config:
        return WeightScheme("gguf", "the GGUF file's blocks", prequantized=True)
    if torchao_config:
        group = int(torchao_config.removeprefix("int4wo-")) if torchao_config.startswith("int4wo-") else 0
        return WeightScheme(TORCHAO_SCHEMES[torchao_config], f"--torchao-config {torchao_config}, quantized at load", group=group)
    return WeightScheme("none", "unquantized")

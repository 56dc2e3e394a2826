"""Which weight quantization a server runs, from SGLang's flags and the checkpoint's config.

SGLang's names and meanings:
  * `--quantization w8a8_int8`: per-output-channel symmetric int8 weights, per-token dynamic
    symmetric int8 activations, an int8 GEMM. A checkpoint that holds int8 weights with their
    scales (SGLang's w8a8_int8 layout, compressed-tensors' int-quantized) loads as it is; an
    unquantized one (bf16, fp16, fp32) is quantized at load (SGLang needs a pre-quantized one).
  * `--torchao-config int8wo`: per-output-channel symmetric int8 weights, activations in the
    model's dtype (torchao's int8_weight_only); `int8dq` is w8a8_int8's arithmetic under
    torchao's name. Computed by our own kernels (int8_linear.py), not torchao's.
  * `--torchao-config int4wo-<group>` (32, 64, 128, 256): 4-bit asymmetric weights per group along the
    input, quantized at load and held in the GGUF path's 4-bit tiles (models/int4_weights.py).
  * `--quantization compressed-tensors`, or none with a config.json whose quantization_config
    says compressed-tensors: the W8A8 int8 scheme (channel weights, dynamic token activations)
    is read through the `compressed-tensors` package; other schemes are refused by name.
  * `--quantization fp8`, or a config.json saying fp8: fp8 e4m3 weights with per-channel or
    per-tensor scales, dequantized at load on CPU; on CUDA held in fp8 (untested here).
  * `--quantization gguf` / `--load-format gguf`: a GGUF file (gguf_checkpoint.py), dequantized
    at load: the weights then serve unquantized, in the serving dtype.
Every other SGLang method name is refused by name, as are unknown torchao configs.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.settings.fields import arg

# SGLang 0.5.9's QUANTIZATION_CHOICES; the ones radixrt runs are SUPPORTED_QUANTIZATION.
SGLANG_QUANTIZATION = (
    "awq", "fp8", "mxfp8", "gptq", "marlin", "gptq_marlin", "awq_marlin", "bitsandbytes", "gguf", "modelopt",
    "modelopt_fp8", "modelopt_fp4", "petit_nvfp4", "w8a8_int8", "w8a8_fp8", "moe_wna16", "qoq", "w4afp8", "mxfp4",
    "auto-round", "compressed-tensors", "modelslim", "quark_int4fp8_moe",
)
SUPPORTED_QUANTIZATION = ("w8a8_int8", "compressed-tensors", "fp8", "gguf")
# SGLang's --torchao-config values ("" is off); the ones radixrt runs map to a scheme.
SGLANG_TORCHAO = ("int8dq", "int8wo", "int4wo-<group_size>", "fp8wo", "fp8dq-per_tensor", "fp8dq-per_row")
TORCHAO_SCHEMES = {"int8wo": "int8wo", "int8dq": "w8a8_int8"} | {f"int4wo-{g}": "int4wo" for g in (32, 64, 128, 256)}
LOAD_FORMATS = ("auto", "safetensors", "gguf")  # SGLang's --load-format values radixrt reads


@dataclass(frozen=True)
class WeightScheme:
    """How the linear layers hold and multiply their weights."""

    name: str  # "none", "w8a8_int8", "int8wo", "int4wo", "fp8" or "gguf" (a GGUF file's blocks)
    source: str  # what chose it, for the log and /get_server_info
    prequantized: bool = False  # the checkpoint holds the quantized tensors (else quantized at load)
    group: int = 0  # int4wo's group size

    @property
    def int8(self) -> bool:
        return self.name in ("w8a8_int8", "int8wo")


def check_quantization_args(quantization: str | None, torchao_config: str, load_format: str) -> None:
    """Raise ValueError naming a flag value radixrt does not run (SGLang's other names included)."""
    if quantization is not None and quantization not in SUPPORTED_QUANTIZATION:
        known = "one of SGLang's methods, not run by radixrt" if quantization in SGLANG_QUANTIZATION else \
            "not a quantization method"
        raise ValueError(f"quantization {quantization!r} is {known}; radixrt runs {', '.join(SUPPORTED_QUANTIZATION)}")
    if torchao_config and torchao_config not in TORCHAO_SCHEMES:
        raise ValueError(f"torchao_config {torchao_config!r} is not run by radixrt; it runs "
                         f"{', '.join(TORCHAO_SCHEMES)} (SGLang's choices: {', '.join(SGLANG_TORCHAO)})")
    if torchao_config and quantization not in (None, "gguf"):
        raise ValueError(f"torchao_config {torchao_config!r} and quantization {quantization!r} both quantize the "
                         "weights: give one")
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")


@dataclass(frozen=True)
class QuantArgs:
    quantization: str | None = arg(
        None, "weight quantization (SGLang's names): w8a8_int8 (int8 weights and per-token int8 activations; an "
        "unquantized checkpoint is quantized at load), compressed-tensors or fp8 (pre-quantized checkpoints, also "
        "read from config.json's quantization_config), gguf (a GGUF file); others are refused"
    )
    torchao_config: str = arg(
        "", "SGLang's torchao option, computed by radixrt's own kernels: int8wo (int8 weights, activations in the "
        "model dtype), int8dq (as w8a8_int8) or int4wo-<group> (4-bit weights per 32, 64, 128 or 256 inputs; CPU)"
    )
    load_format: str = arg("auto", "auto (safetensors, or GGUF for a .gguf model_path), safetensors or gguf")

    def check(self) -> None:
        check_quantization_args(self.quantization, self.torchao_config, self.load_format)

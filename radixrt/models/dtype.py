"""The dtype a model runs in: `--dtype`, or under `auto` the rule below.

SGLang 0.5.9 (`_get_and_verify_dtype`, after vLLM) serves a checkpoint whose
config.json says float32 in float16, or in bfloat16 for Gemma model types
(float16 overflows their activations); any other dtype as configured, and a
config without one as float32. radixrt follows it on CUDA. On a CPU the
configured dtype stays: bench/dtype_cpu.py measured bfloat16 slower than
float32 on this project's CPUs (2-core AVX2 EPYC, no bf16 units; bf16 speed
over fp32, prefill / decode: 0.53 / 0.73 on the tiny model, 0.17 / 0.78 on
the ~100M one; bench/results/dtype_cpu.json), so downcasting there would cost
speed, and exactness too (the CPU parity tests hold float32 checkpoints to
transformers in float32), for nothing.

An explicit `--dtype float32` is served as asked, as in SGLang. On CUDA only the torch attention
backend can run it: FlashInfer has kernels for bfloat16 and float16 queries alone (a float32
plan is a KeyError inside it), so FlashInferBackend refuses a float32 model when the worker
starts, naming the dtype and the ways out (tests/test_cuda_dtype.py).
"""

from __future__ import annotations

# config.json spellings of a dtype -> our names (ServerArgs.dtype's)
CONFIG_DTYPES = {
    "float32": "float32", "float": "float32",
    "float16": "float16", "half": "float16",
    "bfloat16": "bfloat16",
}


def resolve_dtype(config_dtype: str | None, model_type: str, device_type: str, requested: str = "auto") -> str:
    """float32, float16 or bfloat16: the requested dtype, or auto's choice for this checkpoint on
    this device ("cuda" or "cpu"). Raises ValueError for a config dtype it cannot name."""
    if requested != "auto":
        return requested
    name = str(config_dtype or "float32").removeprefix("torch.")
    if name not in CONFIG_DTYPES:
        raise ValueError(f"config.json dtype {config_dtype!r} is not one of {', '.join(CONFIG_DTYPES)}; pass --dtype")
    configured = CONFIG_DTYPES[name]
    if configured == "float32" and device_type == "cuda":
        return "bfloat16" if model_type.startswith("gemma") else "float16"
    return configured

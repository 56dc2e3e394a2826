"""The model and how it runs: the checkpoint, dtypes, device, context, attention backend, and
the process-wide knobs (watchdog, seed, log level)."""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.settings.fields import arg

DTYPES = ("auto", "float32", "bfloat16", "float16")
CPU_MATMUL_DTYPES = ("auto", "model", "float32")  # radixrt/models/cpu_matmul.py
CPU_WEIGHT_PACKINGS = ("auto", "onednn", "none")  # radixrt/models/cpu_matmul.py
# SGLang's names for our attention backends (radixrt/kernels/registry.py), normalized at construction
ATTENTION_BACKEND_ALIASES = {"torch_native": "torch"}


@dataclass(frozen=True)
class ModelArgs:
    model_path: str = arg(
        None, "directory of a Hugging Face checkpoint (config.json, *.safetensors, tokenizer), or a Hugging Face repo id "
        "found in the Hugging Face cache (HF_HUB_CACHE) or downloaded into it unless HF_HUB_OFFLINE is set"
    )
    tokenizer_path: str | None = arg(None, "tokenizer directory or Hugging Face repo id (default: model_path)")
    revision: str | None = arg(
        None, "branch, tag or commit of the Hugging Face repo ids given as model_path and tokenizer_path (default: main)"
    )
    served_model_name: str | None = arg(None, "model name in the OpenAI API (default: model_path)")
    weight_version: str = arg(
        "default", "label of the weights served, reported in /get_model_info and every result's meta_info; "
        "update_weights_from_disk may change it"
    )
    dtype: str = arg(
        "auto", "weights and activations dtype: float32, bfloat16, float16 or auto: config.json's, except that a float32 "
        "checkpoint runs in float16 on CUDA (bfloat16 for Gemma), as in SGLang; on CPU config.json's"
    )
    device: str = arg("auto", "cpu, cuda or auto (cuda when available)")
    cpu_matmul_dtype: str = arg(
        "auto", "on CPU, what a bfloat16/float16 model's linear layers compute in: model (its dtype), float32 (exact "
        "float32 copies of its weights; faster where the CPU has no half GEMM units), or auto: from the CPU's flags "
        "(amx_bf16, avx512_bf16; amx_fp16, avx512_fp16), confirmed by an interleaved measurement"
    )
    cpu_weight_packing: str = arg(
        "auto", "on CPU, how the linear layers multiply: onednn (through weights packed once for oneDNN, as vLLM's CPU "
        "linears; an error where oneDNN cannot pack the weights' dtype), none (torch's F.linear), or auto: onednn "
        "wherever oneDNN packs the dtype on this CPU"
    )
    context_length: int | None = arg(None, "maximum tokens per sequence (default: the model's max_position_embeddings)")
    attention_backend: str | None = arg(
        None, "attention kernel: flashinfer (default on CUDA) or torch (default on CPU; SGLang's name torch_native too)"
    )
    watchdog_timeout: float = arg(300.0, "seconds a step may take before the server gives up on a hung worker")
    random_seed: int = arg(0, "seed of the global sampling RNG")
    log_level: str = arg("info", "logging level: debug, info, warning, error")

    def check(self) -> None:
        if not self.model_path:
            raise ValueError("model_path is required")
        if self.attention_backend in ATTENTION_BACKEND_ALIASES:  # frozen: the one rewrite, at construction
            object.__setattr__(self, "attention_backend", ATTENTION_BACKEND_ALIASES[self.attention_backend])
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.cpu_matmul_dtype not in CPU_MATMUL_DTYPES:
            raise ValueError(f"cpu_matmul_dtype must be one of {CPU_MATMUL_DTYPES}, got {self.cpu_matmul_dtype!r}")
        if self.cpu_weight_packing not in CPU_WEIGHT_PACKINGS:
            raise ValueError(
                f"cpu_weight_packing must be one of {CPU_WEIGHT_PACKINGS}, got {self.cpu_weight_packing!r}"
            )
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.watchdog_timeout <= 0:
            raise ValueError(f"watchdog_timeout must be > 0, got {self.watchdog_timeout}")
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

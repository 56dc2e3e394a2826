"""What the children send the launcher when they are ready, or failed to start."""

from __future__ import annotations

from typing import Union

import msgspec

from radixrt.messages.results import WorkerMemory


class WorkerReady(msgspec.Struct, tag=True):
    num_pages: int
    page_size: int
    vocab_size: int
    context_length: int
    eos_ids: list[int]
    bytes_per_token: int
    page_bytes: int = 0  # one page of one rank, all buffers
    host_pages: int = 0  # the host tier / swap pool (0: none)
    disk_dir: str = ""  # the disk tier's directory for this model ("" : none)
    disk_pages: int = 0
    # the start-up probe of the tiers (worker/tier_probe.py): seconds to bring one page back to the
    # device from host memory and from disk (0.0: no such tier, or not measured), and the model's
    # attention FLOPs per attended position over its other FLOPs per token (scheduler/tier_costs.py)
    h2d_s_per_page: float = 0.0
    disk2d_s_per_page: float = 0.0
    attention_per_position: float = 0.0
    # longrope models: prompts longer than this run under other rope factors, so their KV lives in
    # its own prefix-cache namespace (0: no such model)
    long_prompt_threshold: int = 0
    # what one rank allocated, in bytes (the figures `radixrt estimate` predicts)
    kv_pool_bytes: int = 0  # every tensor of the paged pool (values, scales, the padding page)
    page_table_bytes: int = 0
    weight_bytes: int = 0  # the model's parameters on this rank
    lora_pool_bytes: int = 0  # the LoRA adapter slots' tensors on this rank (0: no --enable-lora)
    weights_fingerprint: str = ""  # the weights' content, dtypes, page size and tp split (worker/kv_tiers.py)
    # bounded-KV retention: why this worker cannot run a policy ("" : it can), per policy
    retention_refusals: dict[str, str] = {}
    memory: WorkerMemory | None = None  # rank 0's, once loaded
    matmul_dtype: str = ""  # what the linear layers compute in (models/cpu_matmul.py), and why
    matmul_dtype_reason: str = ""
    weight_packing: str = ""  # "onednn" or "none": through which kernel they multiply, and why
    weight_packing_reason: str = ""
    weight_quantization: str = ""  # "none", "w8a8_int8", "int8wo", "fp8" or "gguf" (models/checkpoint_quant.py), and why
    weight_quantization_reason: str = ""
    # the attention kernel of each shape class (decode, extend, cascade: kernels/kernel_choice.py), and why
    attention_kernels: dict[str, str] = {}
    attention_kernels_reason: str = ""


class SchedulerReady(msgspec.Struct, tag=True):
    max_total_tokens: int


class ChildFailed(msgspec.Struct, tag=True):
    who: str
    error: str


ReadyMsg = Union[WorkerReady, SchedulerReady, ChildFailed]

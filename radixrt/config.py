"""Server arguments: one frozen dataclass, validated at construction.

Field names are SGLang's (snake_case of the CLI flags). `ServerArgs.from_kwargs`
rejects unknown names, so a typo is an error rather than a silent default.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from radixrt import kv_storage
from radixrt.kv_settings import KV_FORMAT_NAMES, check_kv_args
from radixrt.lora_settings import LoraServing, check_lora_args
from radixrt.pooling import check_pooler_config
from radixrt.quant_settings import check_quantization_args
from radixrt.reasoning import REASONING_PARSERS
from radixrt.retention.policies import wants_mass
from radixrt.retention.settings import Retention, server_settings
from radixrt.scheduling_settings import TIMEOUT_ENV, check_scheduling_args, env_timeout, load_api_keys
from radixrt.speculative.settings import SpecSettings, spec_settings

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = KV_FORMAT_NAMES  # radixrt/kv_settings.py: one of them, or K:V of two
CPU_MATMUL_DTYPES = ("auto", "model", "float32")  # radixrt/models/cpu_matmul.py
CPU_WEIGHT_PACKINGS = ("auto", "onednn", "none")  # radixrt/models/cpu_matmul.py
PREEMPTION_MODES = ("recompute", "swap", "auto")
TOOL_CALL_PARSERS = (  # radixrt/server/tool_calls.py
    "hermes", "qwen25", "llama3", "mistral", "pythonic", "deepseekv3", "qwen3_coder", "gpt-oss",
)
CHAT_TEMPLATE_NAMES = (  # radixrt/server/chat_templates.py
    "chatml", "qwen", "qwen2-vl", "llama-2", "llama-3-instruct", "llama-4", "mistral", "gemma-it", "vicuna_v1.1",
    "internlm2-chat", "phi-4-mm",
)
SAMPLING_DEFAULTS = ("model", "openai")
# The quantized-KV start-up check's default floor (radixrt/worker/kv_calibration.py), set from the
# real trained model SmolLM2-135M-Instruct on the check's built-in prompts (663 positions,
# tests/test_real_model.py): int8 agrees 0.989 in float32 and 0.959 in bf16, fp8_e4m3 0.952 and
# 0.940, fp8_e5m2 0.926 and 0.910. The former floor of 0.9 passed bf16 fp8_e5m2 by 6 positions,
# so another prompt set or CPU could refuse a healthy pool. 0.85 passes every healthy pool by
# at least 0.06 and still refuses fp8 scales that clip (0.70). Random-weight tiny models, whose
# near-tied logits flip, agree 0.95 (int8) and 0.60-0.78 (fp8). int8 weights (w8a8_int8) agree
# 0.935 in float32 (tests/test_real_model_quant.py holds them to this floor too).
KV_QUANT_MIN_AGREEMENT = 0.85
# The whitespace constrained JSON allows between its tokens (xgrammar's max_whitespace_cnt) unless
# set: SGLang allows any, and a random-weight model then spends its budget on newlines. From
# bench/json_whitespace.py (tiny llama and qwen2, 3 schemas, 30 seeded runs each, 200 tokens): valid
# JSON in 43% of runs compact, 48/54/46/48% at bounds 1/2/3/4, 39% at 8 and 20% with any (runs of up
# to 164 whitespace characters); mean tokens grow with the bound (108 compact, 140 at 4, 177 any).
# 4 is the largest bound that ends as often as the smallest, and it still lets a model pretty-print:
# a newline and three spaces (indent 2 one level deep) or three tabs.
JSON_MAX_WHITESPACE = 4
# SGLang's --constrained-json-whitespace-pattern, in the one form that maps onto the bound: a class of
# JSON whitespace (literal, or escaped \n \t \r \s) repeated {0,n} times, or * (any number).
_JSON_WHITESPACE_PATTERN = re.compile(r"\[(?:\\[ntrs]|[ \n\t\r])+\](?:\{0,(?P<n>\d+)\}|\*)")
# SGLang's names for our attention backends (radixrt/kernels/registry.py), normalized at construction
ATTENTION_BACKEND_ALIASES = {"torch_native": "torch"}


def _arg(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class ServerArgs:
    model_path: str = _arg(
        None, "directory of a Hugging Face checkpoint (config.json, *.safetensors, tokenizer), or a Hugging Face repo id "
        "found in the Hugging Face cache (HF_HUB_CACHE) or downloaded into it unless HF_HUB_OFFLINE is set"
    )
    tokenizer_path: str | None = _arg(None, "tokenizer directory or Hugging Face repo id (default: model_path)")
    revision: str | None = _arg(
        None, "branch, tag or commit of the Hugging Face repo ids given as model_path and tokenizer_path (default: main)"
    )
    served_model_name: str | None = _arg(None, "model name in the OpenAI API (default: model_path)")
    weight_version: str = _arg(
        "default", "label of the weights served, reported in /get_model_info and every result's meta_info; "
        "update_weights_from_disk may change it"
    )
    host: str = _arg("127.0.0.1", "HTTP host to bind (launch_server)")
    port: int = _arg(30000, "HTTP port to bind (launch_server)")
    api_key: str | None = _arg(None, "require 'Authorization: Bearer <key>' on every endpoint but /health* and /metrics")
    admin_api_key: str | None = _arg(
        None, "key for the admin endpoints (/abort_request, /flush_cache); without it they take api_key"
    )
    allowed_hosts: str | None = _arg(
        None, "comma-separated Host names (name or name:port) served, beyond the loopback names and addresses and "
        "the bind address (bound to 0.0.0.0 or ::, any IP address too); '*' serves any. Checked, with Origin and "
        "Content-Type, on routes that take no API key, against DNS rebinding and cross-site requests from web pages"
    )
    max_request_bytes: int = _arg(32 << 20, "largest request body in bytes; a larger one gets 413 before it is parsed")
    max_n: int = _arg(128, "largest n (parallel samples) one request may ask for")
    max_requests_per_call: int = _arg(
        1024, "most requests one HTTP call may make (its prompts times n); a larger call gets 400 before any of it runs"
    )
    allow_auto_truncate: bool = _arg(
        False, "truncate a prompt (and max_new_tokens) that exceeds the context instead of refusing it with a 400"
    )
    request_read_timeout: float = _arg(
        30.0, "seconds a client has to send a request's headers and body; an idle or half-sent connection is closed"
    )
    max_connections: int = _arg(
        2048, "open HTTP connections at most; beyond it new requests get 503, but for GET /health, always answered"
    )
    graceful_shutdown_timeout: float = _arg(
        30.0, "on SIGTERM, seconds in-flight requests may take to finish before they get a 503"
    )
    dtype: str = _arg(
        "auto", "weights and activations dtype: float32, bfloat16, float16 or auto: config.json's, except that a float32 "
        "checkpoint runs in float16 on CUDA (bfloat16 for Gemma), as in SGLang; on CPU config.json's"
    )
    device: str = _arg("auto", "cpu, cuda or auto (cuda when available)")
    cpu_matmul_dtype: str = _arg(
        "auto", "on CPU, what a bfloat16/float16 model's linear layers compute in: model (its dtype), float32 (exact "
        "float32 copies of its weights; faster where the CPU has no half GEMM units), or auto: from the CPU's flags "
        "(amx_bf16, avx512_bf16; amx_fp16, avx512_fp16), confirmed by an interleaved measurement"
    )
    cpu_weight_packing: str = _arg(
        "auto", "on CPU, how the linear layers multiply: onednn (through weights packed once for oneDNN, as vLLM's CPU "
        "linears; an error where oneDNN cannot pack the weights' dtype), none (torch's F.linear), or auto: onednn "
        "wherever oneDNN packs the dtype on this CPU"
    )
    quantization: str | None = _arg(
        None, "weight quantization (SGLang's names): w8a8_int8 (int8 weights and per-token int8 activations; an "
        "unquantized checkpoint is quantized at load), compressed-tensors or fp8 (pre-quantized checkpoints, also "
        "read from config.json's quantization_config), gguf (a GGUF file); others are refused"
    )
    torchao_config: str = _arg(
        "", "SGLang's torchao option, computed by radixrt's own kernels: int8wo (int8 weights, activations in the "
        "model dtype), int8dq (as w8a8_int8) or int4wo-<group> (4-bit weights per 32, 64, 128 or 256 inputs; CPU, one rank)"
    )
    load_format: str = _arg("auto", "auto (safetensors, or GGUF for a .gguf model_path), safetensors or gguf")
    context_length: int | None = _arg(None, "maximum tokens per sequence (default: the model's max_position_embeddings)")
    page_size: int = _arg(1, "tokens per KV page")
    max_total_tokens: int | None = _arg(None, "KV pool size in tokens (overrides mem_fraction_static)")
    mem_fraction_static: float | None = _arg(
        None, "fraction of device memory for weights + KV pool (default 0.88 on CUDA, 0.3 of available RAM on CPU)"
    )
    chunked_prefill_size: int = _arg(
        4096, "the most prompt tokens one request prefills in a step (a longer prompt runs in chunks of this many); "
        "-1 disables chunking"
    )
    max_prefill_tokens: int = _arg(
        16384, "the most prompt tokens prefilled in one step, all requests together (SGLang's per-batch budget)"
    )
    max_decode_slowdown: float = _arg(
        1.5, "while streamed requests decode, a step's prefill tokens are cut so that the step is predicted (from "
        "measured step times) to take at most this many times a decode-only step: long prompts cannot stall the "
        "tokens a client is reading, at the cost of their own TTFT (a request answered in one piece has no pace to "
        "keep: it never cuts a step); 0: off (a step prefills up to max_prefill_tokens)"
    )
    max_running_requests: int = _arg(256, "maximum requests in the running batch")
    schedule_policy: str = _arg(
        "lpm", "admission order within a priority level and a tenant's share: lpm (longest cached prefix first) or fcfs"
    )
    enable_priority_scheduling: bool = _arg(
        False, "admit waiting requests by their priority field first (larger is more important; a request without "
        "one is the least important), then by schedule_policy; see priority_scheduling_preemption_threshold"
    )
    schedule_low_priority_values_first: bool = _arg(False, "with priority scheduling, smaller priority values go first")
    priority_scheduling_preemption_threshold: int = _arg(
        10, "with priority scheduling, a waiting request whose priority exceeds a running one's by more than this "
        "preempts it (by preemption_mode) when no slot or pages are free"
    )
    abort_on_priority_when_disabled: bool = _arg(
        False, "without priority scheduling, answer a request that sets priority with a 503 (else it is ignored)"
    )
    max_queued_requests: int | None = _arg(
        None, "the most requests waiting to run; a new one beyond it gets a 503 (with priority scheduling, the "
        "least important waiting request gets it instead when the new one outranks it)"
    )
    req_waiting_timeout: float | None = _arg(
        None, "seconds a request may wait before it first runs; then it ends with a 503 (default: "
        "SGLANG_REQ_WAITING_TIMEOUT, else none)"
    )
    req_running_timeout: float | None = _arg(
        None, "seconds a request may run from its first step; then it ends with a 503 (default: "
        "SGLANG_REQ_RUNNING_TIMEOUT, else none)"
    )
    api_keys_file: str | None = _arg(
        None, 'JSON {"<key>": {"tenant": NAME, "weight": 1.0, "kv_quota": FRACTION, "share_cache": false}}: each '
        "key is accepted as api_key is and names its tenant (fair share by weight, KV quota, a cache of its own "
        "unless share_cache); without it a request's tenant is its cache_salt"
    )
    tenant_kv_quota: float = _arg(
        1.0, "the cached KV pages one tenant may hold before its pages are evicted first, as a fraction of the "
        "device pool (a keys file's kv_quota overrides it per tenant); pins past it are refused; 1: no quota"
    )
    enable_lora: bool = _arg(False, "serve LoRA adapters (set by --lora-paths): docs/lora.md")
    lora_paths: list[str] | None = _arg(
        None, "adapters served from the start: NAME=PATH, PATH (named by its path) or JSON "
        '{"lora_name": ..., "lora_path": ..., "pinned": false}; PATH is a PEFT checkpoint directory'
    )
    max_lora_rank: int | None = _arg(None, "the largest adapter rank the slots hold (default: the largest of --lora-paths)")
    lora_target_modules: list[str] | None = _arg(
        None, "the modules adapters may add to: q_proj k_proj v_proj o_proj gate_proj up_proj down_proj qkv_proj "
        "gate_up_proj, or all (default: those of --lora-paths)"
    )
    max_loras_per_batch: int = _arg(
        8, "adapter slots in the model: the distinct adapters one step runs at most (the base model not counted)"
    )
    max_loaded_loras: int | None = _arg(
        None, "adapters registered at most; loading one more unloads the least recently used unpinned one "
        "(default: no limit)"
    )
    lora_eviction_policy: str = _arg("lru", "which idle unpinned adapter leaves its slot for another: lru or fifo")
    lora_backend: str = _arg(
        "csgmv", "SGLang's LoRA kernels (triton, csgmv, ascend, torch_native): every choice runs radixrt's grouped "
        "torch matmuls"
    )
    radix_eviction_policy: str = _arg(
        "lru", "the order cached KV pages leave the device pool and the host and disk tiers (always leaves first): "
        "lru (least recently used), lfu (fewest hits, then least recently used) or cost (hits weighted by what the "
        "pages cost to recompute, aged greedy-dual style)"
    )
    max_pinned_fraction: float = _arg(
        0.25, "pages that requests may pin with cache_control (kept cached for a TTL), as a fraction of the device "
        "KV pool plus the host tier; a pin past it is refused with a 400 (0: no pins)"
    )
    max_pinned_namespace_fraction: float = _arg(
        1.0, "the pinned pages one cache namespace (cache_salt) may hold, as a fraction of the pin budget"
    )
    disable_radix_cache: bool = _arg(False, "do not reuse KV across requests (every prompt is computed in full)")
    chat_template: str | None = _arg(
        None, "the chat template used instead of the tokenizer's own: a Jinja file, or one of SGLang's template names "
        f"({', '.join(CHAT_TEMPLATE_NAMES)})"
    )
    tool_call_parser: str | None = _arg(
        None, "how /v1/chat/completions finds tool calls in the model's text: hermes, qwen25, llama3, mistral, "
        "pythonic, deepseekv3, qwen3_coder or gpt-oss"
    )
    reasoning_parser: str | None = _arg(
        None, "how /v1/chat/completions separates the model's reasoning from its answer (message.reasoning_content), "
        f"by SGLang's format names: {', '.join(REASONING_PARSERS)}"
    )
    is_embedding: bool = _arg(
        False, "serve embeddings only (SGLang's): /encode, /v1/embeddings and a cross-encoder's /v1/rerank answer, the "
        "generating routes refuse; without it the server generates and serves embeddings, scores and reranking too"
    )
    pooler_config: str | None = _arg(
        None, "vLLM's pooler override, JSON: {\"pooling_type\": \"LAST\" | \"MEAN\" | \"CLS\", \"normalize\": bool}; "
        "default: the checkpoint's sentence-transformers modules, else the last token, normalized"
    )
    disable_jump_forward: bool = _arg(
        False, "sample every token of a constrained output, even where its grammar allows only one continuation"
    )
    constrained_json_disable_any_whitespace: bool = _arg(
        False, "JSON-schema constraints allow no whitespace between tokens (compact JSON) instead of any"
    )
    constrained_json_max_whitespace: int = _arg(
        JSON_MAX_WHITESPACE, "JSON-schema constraints allow at most this many whitespace characters (space, "
        "newline, tab, carriage return) between JSON tokens: -1 any number (SGLang's default), 0 compact JSON (as "
        "--constrained-json-disable-any-whitespace)"
    )
    constrained_json_whitespace_pattern: str | None = _arg(
        None, "SGLang's whitespace regex, accepted in the form [chars]{0,n} (or [chars]* for any number): it sets the "
        "bound n of --constrained-json-max-whitespace; the characters stay JSON's four (xgrammar cannot narrow them)"
    )
    sampling_defaults: str = _arg(
        "model", "where a chat completion's unset temperature, top_p, top_k, min_p and repetition_penalty come from: "
        "model (the checkpoint's generation_config.json) or openai (1.0, 1.0, -1, 0.0, 1.0), as in SGLang"
    )
    enable_metrics: bool = _arg(False, "accepted for SGLang compatibility: /metrics is always on")
    dp_size: int = _arg(1, "data-parallel server replicas behind sglang_router (cache_aware) on the public port")
    # The router's own names (sglang_router.launch_server spells them --router-*). Only the absolute
    # balance floor differs from sglang_router's default (64): see docs/architecture.md, data parallelism.
    router_cache_threshold: float = _arg(
        0.3, "with dp_size > 1: a request goes to the replica whose routed text shares the longest prefix with it "
        "when that prefix is more than this fraction of its text; otherwise (a cache miss) to the least loaded one"
    )
    router_balance_abs_threshold: int = _arg(
        2, "with dp_size > 1: the replicas count as imbalanced, and a request goes to the least loaded one whatever "
        "its prefix, when the busiest has more than this many requests in flight over the idlest (and "
        "router_balance_rel_threshold holds too); sglang_router's default is 64"
    )
    router_balance_rel_threshold: float = _arg(
        1.5, "with dp_size > 1: imbalanced also needs the busiest replica's requests in flight to exceed this "
        "multiple of the idlest's (>= 1)"
    )
    attention_backend: str | None = _arg(
        None, "attention kernel: flashinfer (default on CUDA) or torch (default on CPU; SGLang's name torch_native too)"
    )
    tp_size: int = _arg(1, "tensor parallel ranks (worker processes; gloo on CPU, NCCL on CUDA)")
    nnodes: int = _arg(1, "nodes the tensor-parallel ranks span (tp_size / nnodes ranks per node)")
    node_rank: int = _arg(0, "this node's index; node 0 runs the scheduler and the HTTP server")
    dist_init_addr: str | None = _arg(None, "host:port of node 0 where the nodes meet (required when nnodes > 1)")
    cuda_graph_max_bs: int = _arg(256, "largest decode batch run from a captured CUDA graph")
    disable_cuda_graph: bool = _arg(False, "run decode eagerly instead of from captured CUDA graphs")
    kv_cache_dtype: str = _arg(
        "auto", "KV pool storage: auto (the model's dtype), fp8_e4m3, fp8_e5m2, int8 or int4 (a float16 scale per 32 "
        "elements); K:V for keys and values apart, e.g. int8:int4 (fp8 does not mix)"
    )
    kv_cache_rotation: str = _arg(
        "auto", "store keys rotated by a Hadamard matrix per head, which spreads outlier channels before they are "
        "quantized (queries are rotated alike: scores unchanged): auto (where keys are int4), on (any quantized "
        "keys), off"
    )
    kv_calibration_file: str | None = _arg(
        None, "text file of calibration prompts (paragraphs separated by blank lines) for the quantized-KV start-up "
        "check (default: built-in prose, a number table and code)"
    )
    kv_scales_file: str | None = _arg(
        None, 'fp8 KV per-layer scales, JSON {"k_scale": [...], "v_scale": [...]} (default: fitted to the K/V '
        "ranges of the start-up check)"
    )
    kv_quant_min_agreement: float = _arg(
        KV_QUANT_MIN_AGREEMENT, "with a quantized kv_cache_dtype, refuse to start when the start-up check's top-1 "
        "agreement with model-dtype KV is below this"
    )
    kv_retention: str = _arg(
        "none", "bounded KV per request: none (keep every token), sink_window (the first kv_sink_tokens and the last "
        "kv_window_tokens, StreamingLLM) or heavy_hitter (the last kv_window_tokens and the pages that drew the most "
        "attention, H2O); a request under a policy may generate past the context length. Requests may override it "
        "(sampling_params.kv_retention)"
    )
    kv_sink_tokens: int = _arg(4, "sink_window: leading tokens always kept (rounded up to whole pages)")
    kv_window_tokens: int = _arg(1024, "sink_window and heavy_hitter: the most recent tokens kept")
    kv_heavy_ratio: float = _arg(
        0.2, "heavy_hitter: heavy-hitter tokens kept beyond the window, as a fraction of kv_window_tokens (H2O's 0.2)"
    )
    enable_hierarchical_cache: bool = _arg(
        False, "keep radix-cache pages evicted from the device pool in host memory (and on disk with hicache_dir)"
    )
    hicache_ratio: float = _arg(2.0, "host tier size as a multiple of the device KV pool (when hicache_size is 0)")
    hicache_size: float = _arg(0.0, "host tier size in GB (0: use hicache_ratio)")
    hicache_dir: str | None = _arg(None, "directory of the disk tier (pages spilled from host memory; kept across restarts)")
    hicache_disk_size: float = _arg(16.0, "disk tier size in GB")
    hicache_write_policy: str = _arg(
        "write_through", "when a device page is copied to the host tier: write_through (as soon as it is cached), "
        "write_through_selective (when a request hits it the second time) or write_back (when it is evicted)"
    )
    hicache_load_policy: str = _arg(
        "measured", "whether a request reads back pages the host and disk tiers hold: measured (only where loading "
        "them is measured to be faster than recomputing them) or always"
    )
    hicache_disk_max_errors: int = _arg(
        8, "disk tier I/O errors in a row after which the disk tier turns itself off (its pages are then recomputed)"
    )
    hicache_storage_backend: str | None = _arg(
        None, "the tier below host memory: file (the disk tier: hicache_dir, else $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, "
        "else /tmp/hicache) or mooncake (a Mooncake Store every server on its master shares; see docs/kv_storage.md)"
    )
    hicache_storage_prefetch_policy: str = _arg(
        "best_effort", "how long a load from the storage backend may hold its step: best_effort or wait_complete (every "
        "page the measured cost picks), timeout (pages not read by prefetch_timeout_base + prefetch_timeout_per_ki_token "
        "per 1024 tokens, SGLang's 1 s + 0.25 s, are recomputed)"
    )
    hicache_storage_backend_extra_config: str | None = _arg(
        None, "the storage backend's settings: a JSON object, or '@' and a JSON, YAML or TOML file (mooncake: "
        "master_server_address, protocol, global_segment_size, ...; timeout: prefetch_timeout_base, ...)"
    )
    preemption_mode: str = _arg(
        "recompute", "a retracted request's KV: recompute it, swap it to host memory, or auto (swap long ones)"
    )
    swap_space: float = _arg(4.0, "host memory in GB for swapped requests when the hierarchical cache is off")
    # bench/kv_memory.py on CPU: swapping beats recomputing from about 21 tokens (tiny model) and at every
    # measured length (124M model); 64 is the smallest measured length where it won on both.
    swap_min_tokens: int = _arg(64, "auto preemption swaps requests holding at least this many tokens")
    quality_spot_check_rate: float = _arg(
        0.0, "fraction of finished greedy requests re-scored in idle time against model-dtype KV with no retention and "
        "no cache reuse (top-1 agreement and mean |delta logprob| of the emitted tokens, in /metrics); 0: off"
    )
    quality_spot_check_min_agreement: float = _arg(
        0.9, "a spot check whose top-1 agreement is below this logs a warning (at most once a minute)"
    )
    quality_spot_check_queue: int = _arg(64, "spot checks waiting for idle time at most; older ones are skipped")
    speculative_algorithm: str | None = _arg(
        None, "speculative decoding: NGRAM (drafts from the request's own text and the text cached in its namespace) "
        "or STANDALONE (a small draft model); EAGLE, EAGLE3 and NEXTN are refused (no EAGLE heads)"
    )
    speculative_draft_model_path: str | None = _arg(
        None, "STANDALONE: the draft model's checkpoint directory (it must share the target's tokenizer)"
    )
    speculative_draft_model_revision: str | None = _arg(None, "SGLang's; refused when set (the draft is a local directory)")
    speculative_draft_load_format: str | None = _arg(None, "SGLang's; refused when set")
    speculative_num_steps: int | None = _arg(
        None, "STANDALONE: draft tokens proposed per request and step at most (default 3)"
    )
    speculative_eagle_topk: int | None = _arg(None, "SGLang's; only 1 (a chain) is accepted")
    speculative_num_draft_tokens: int | None = _arg(
        None, "tokens verified per request and step at most, the last accepted one included (NGRAM default 8; "
        "STANDALONE: num_steps + 1); the scheduler picks each request's draft length up to it"
    )
    speculative_accept_threshold_single: float = _arg(1.0, "SGLang's relaxed acceptance; only 1.0 (exact) is accepted")
    speculative_accept_threshold_acc: float = _arg(1.0, "SGLang's relaxed acceptance; only 1.0 (exact) is accepted")
    speculative_token_map: str | None = _arg(None, "SGLang's EAGLE token map; refused when set")
    speculative_attention_mode: str = _arg("prefill", "SGLang's; drafts are verified as an extend step (prefill)")
    speculative_draft_attention_backend: str | None = _arg(None, "SGLang's; refused when set (the target's backend runs)")
    speculative_moe_runner_backend: str | None = _arg(None, "SGLang's; refused when set")
    speculative_moe_a2a_backend: str | None = _arg(None, "SGLang's; refused when set")
    speculative_draft_model_quantization: str | None = _arg(None, "SGLang's; refused when set")
    speculative_draft_policy: str = _arg(
        "adaptive", "radixrt's: adaptive (each request's draft length per step from measured acceptance and step "
        "cost, none where drafts would not pay) or max (always the most num_draft_tokens allows: SGLang's behavior)"
    )
    speculative_ngram_min_match_window_size: int = _arg(1, "NGRAM: the shortest suffix of the text matched")
    speculative_ngram_max_match_window_size: int = _arg(12, "NGRAM: the longest suffix of the text matched")
    speculative_ngram_min_bfs_breadth: int = _arg(
        1, "NGRAM, BFS: the draft tree's breadth at the longest match (each level narrows toward 1)")
    speculative_ngram_max_bfs_breadth: int = _arg(
        1, "NGRAM: the draft tree's breadth at the shortest match (BFS), or the continuations each node offers "
        "(PROB); 1 drafts chains")
    speculative_ngram_match_type: str = _arg(
        "BFS", "NGRAM: which continuations of a matched n-gram are drafted: BFS (the most recent first, breadth-first) "
        "or PROB (the most probable branches, by frequency)"
    )
    speculative_ngram_branch_length: int = _arg(18, "NGRAM: tokens indexed after each n-gram")
    speculative_ngram_capacity: int = _arg(
        1_000_000, "NGRAM: entries the index over cached text holds at most (least recently used ones go first)"
    )
    watchdog_timeout: float = _arg(300.0, "seconds a step may take before the server gives up on a hung worker")
    random_seed: int = _arg(0, "seed of the global sampling RNG")
    log_level: str = _arg("info", "logging level: debug, info, warning, error")

    def __post_init__(self) -> None:
        if self.pooler_config is not None:
            check_pooler_config(self.pooler_config)
        if not self.model_path:
            raise ValueError("model_path is required")
        if self.chat_template is not None and not (
            self.chat_template in CHAT_TEMPLATE_NAMES or os.path.isfile(self.chat_template)
        ):
            raise ValueError(f"chat_template {self.chat_template!r} is neither a file nor a template name "
                             f"({', '.join(CHAT_TEMPLATE_NAMES)})")
        if self.sampling_defaults not in SAMPLING_DEFAULTS:
            raise ValueError(f"sampling_defaults must be one of {', '.join(SAMPLING_DEFAULTS)}, "
                             f"got {self.sampling_defaults!r}")
        if self.attention_backend in ATTENTION_BACKEND_ALIASES:  # frozen: the one rewrite, at construction
            object.__setattr__(self, "attention_backend", ATTENTION_BACKEND_ALIASES[self.attention_backend])
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.cpu_matmul_dtype not in CPU_MATMUL_DTYPES:
            raise ValueError(f"cpu_matmul_dtype must be one of {CPU_MATMUL_DTYPES}, got {self.cpu_matmul_dtype!r}")
        if self.cpu_weight_packing not in CPU_WEIGHT_PACKINGS:
            raise ValueError(
                f"cpu_weight_packing must be one of {CPU_WEIGHT_PACKINGS}, got {self.cpu_weight_packing!r}"
            )
        check_quantization_args(self.quantization, self.torchao_config, self.load_format)
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens must be >= page_size, got {self.max_total_tokens}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be -1 or >= 1, got {self.chunked_prefill_size}")
        if self.tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.tp_size}")
        if self.watchdog_timeout <= 0:
            raise ValueError(f"watchdog_timeout must be > 0, got {self.watchdog_timeout}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        self._check_http_limits()
        self._check_json_whitespace()
        if self.schedule_policy not in ("lpm", "fcfs"):
            raise ValueError(f"schedule_policy must be lpm or fcfs, got {self.schedule_policy!r}")
        self._check_scheduling()
        self._check_lora()
        if self.radix_eviction_policy not in ("lru", "lfu", "cost"):
            raise ValueError(f"radix_eviction_policy must be lru, lfu or cost, got {self.radix_eviction_policy!r}")
        if self.hicache_write_policy not in ("write_through", "write_through_selective", "write_back"):
            raise ValueError("hicache_write_policy must be write_through, write_through_selective or write_back, "
                             f"got {self.hicache_write_policy!r}")
        if self.hicache_load_policy not in ("measured", "always"):
            raise ValueError(f"hicache_load_policy must be measured or always, got {self.hicache_load_policy!r}")
        for name in ("max_pinned_fraction", "max_pinned_namespace_fraction"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be between 0 and 1, got {getattr(self, name)}")
        self._check_distributed()
        self._check_kv_memory()
        spec_settings(self)  # ValueError naming the flag
        if self.context_length is not None and self.context_length < 2:
            raise ValueError(f"context_length must be >= 2, got {self.context_length}")

    def _check_json_whitespace(self) -> None:
        if self.constrained_json_max_whitespace < -1:
            raise ValueError("constrained_json_max_whitespace must be -1 (any), 0 (compact) or a bound >= 1, "
                             f"got {self.constrained_json_max_whitespace}")
        if self.constrained_json_whitespace_pattern is None:
            return
        json_whitespace_bound(self.constrained_json_whitespace_pattern)  # ValueError naming the flag
        if self.constrained_json_disable_any_whitespace or self.constrained_json_max_whitespace != JSON_MAX_WHITESPACE:
            raise ValueError("constrained_json_whitespace_pattern sets the same bound as constrained_json_max_whitespace "
                             "and constrained_json_disable_any_whitespace: give one of them")

    def _check_http_limits(self) -> None:
        for name in ("max_request_bytes", "max_n", "max_requests_per_call", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.allowed_hosts is not None and any(not h.strip() or "/" in h for h in self.allowed_hosts.split(",")):
            raise ValueError(f"allowed_hosts must be comma-separated host names (name or name:port), "
                             f"got {self.allowed_hosts!r}")
        if self.request_read_timeout <= 0:
            raise ValueError(f"request_read_timeout must be > 0, got {self.request_read_timeout}")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError(f"graceful_shutdown_timeout must be >= 0, got {self.graceful_shutdown_timeout}")

    def _check_distributed(self) -> None:
        if self.nnodes < 1:
            raise ValueError(f"nnodes must be >= 1, got {self.nnodes}")
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if not 0 <= self.router_cache_threshold <= 1:
            raise ValueError(f"router_cache_threshold must be in [0, 1], got {self.router_cache_threshold}")
        if self.router_balance_abs_threshold < 0:
            raise ValueError(f"router_balance_abs_threshold must be >= 0, got {self.router_balance_abs_threshold}")
        if self.router_balance_rel_threshold < 1:
            raise ValueError(f"router_balance_rel_threshold must be >= 1, got {self.router_balance_rel_threshold}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, nnodes={self.nnodes}), got {self.node_rank}")
        if self.tp_size % self.nnodes:
            raise ValueError(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("dist_init_addr (host:port of node 0) is required when nnodes > 1")
        if self.dist_init_addr is not None:
            host, _, port = self.dist_init_addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65535:
                raise ValueError(f"dist_init_addr must be host:port, got {self.dist_init_addr!r}")
        if self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")

    def _check_kv_memory(self) -> None:
        check_kv_args(self.kv_cache_dtype, self.kv_cache_rotation)
        if self.kv_scales_file is not None and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(f"kv_scales_file holds fp8 scales; kv_cache_dtype is {self.kv_cache_dtype!r}")
        for name in ("kv_calibration_file", "kv_scales_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path!r} is not a file")
        if not 0.0 <= self.kv_quant_min_agreement <= 1.0:
            raise ValueError(f"kv_quant_min_agreement must be in [0, 1], got {self.kv_quant_min_agreement}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        for name in ("hicache_ratio", "hicache_size", "hicache_disk_size", "swap_space"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache needs the radix cache; drop disable_radix_cache")
        if self.enable_hierarchical_cache and self.hicache_size == 0 and self.hicache_ratio == 0:
            raise ValueError("enable_hierarchical_cache needs a host tier: hicache_size > 0 or hicache_ratio > 0")
        if self.hicache_dir is not None and not self.enable_hierarchical_cache:
            raise ValueError("hicache_dir is the disk tier of the hierarchical cache: add enable_hierarchical_cache")
        if self.hicache_dir is not None and self.hicache_disk_size <= 0:
            raise ValueError(f"hicache_disk_size must be > 0 with hicache_dir, got {self.hicache_disk_size}")
        kv_storage.check_storage_args(self)
        if self.hicache_disk_max_errors < 1:
            raise ValueError(f"hicache_disk_max_errors must be >= 1, got {self.hicache_disk_max_errors}")
        if self.swap_min_tokens < 0:
            raise ValueError(f"swap_min_tokens must be >= 0, got {self.swap_min_tokens}")
        self._check_retention()
        self._check_spot_checks()

    def _check_spot_checks(self) -> None:
        for name in ("quality_spot_check_rate", "quality_spot_check_min_agreement"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.quality_spot_check_queue < 1:
            raise ValueError(f"quality_spot_check_queue must be >= 1, got {self.quality_spot_check_queue}")

    def _check_scheduling(self) -> None:
        for flag in TIMEOUT_ENV:  # the flag wins over SGLang's environment variable
            if getattr(self, flag) is None:
                object.__setattr__(self, flag, env_timeout(flag))
        check_scheduling_args(self.priority_scheduling_preemption_threshold, self.max_queued_requests,
                              {flag: getattr(self, flag) for flag in TIMEOUT_ENV}, self.tenant_kv_quota,
                              self.max_prefill_tokens, self.max_decode_slowdown)
        if self.api_keys_file is not None:
            load_api_keys(self.api_keys_file)  # ValueError naming the file and the key

    def _check_lora(self) -> None:
        """SGLang's: --lora-paths turns LoRA on. The per-step adapter groups are not graph-capturable:
        decode runs eagerly under LoRA."""
        if self.lora_paths and not self.enable_lora:
            object.__setattr__(self, "enable_lora", True)
        check_lora_args(self)
        if self.enable_lora:
            object.__setattr__(self, "disable_cuda_graph", True)

    def _check_retention(self) -> None:
        settings = self.retention  # ValueError naming the flag
        if wants_mass(settings.policy) and self.attention_backend == "flashinfer":
            raise ValueError("kv_retention heavy_hitter needs per-page attention mass, which the flashinfer backend "
                             "does not report: use attention_backend torch, or kv_retention sink_window")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)

    @property
    def storage_backend(self) -> str | None:
        """What holds the pages below host memory: file (hicache_dir, with or without the flag), mooncake, or None."""
        return self.hicache_storage_backend or ("file" if self.hicache_dir is not None else None)

    @property
    def mooncake(self) -> kv_storage.MooncakeSettings | None:
        """The Mooncake Store's settings (None: another backend, or none)."""
        return kv_storage.mooncake_settings(self.hicache_storage_backend, self.hicache_storage_backend_extra_config)

    @property
    def prefetch_timeout(self) -> tuple[float, float] | None:
        """--hicache-storage-prefetch-policy timeout: (seconds, seconds per 1024 tokens) a load may take."""
        return kv_storage.prefetch_timeout(self.hicache_storage_prefetch_policy, self.hicache_storage_backend,
                                           self.hicache_storage_backend_extra_config)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path

    @property
    def retention(self) -> Retention:
        """The server's retention settings (requests may override them)."""
        return server_settings(self.kv_retention, self.kv_sink_tokens, self.kv_window_tokens, self.kv_heavy_ratio)

    @property
    def speculative(self) -> SpecSettings:
        return spec_settings(self)

    @property
    def lora(self) -> LoraServing | None:
        """The LoRA pool (None without --enable-lora), from the start-up adapters' configs (read
        and hashed on each call: the processes call it once, at start)."""
        return LoraServing.of(self)

    @property
    def json_max_whitespace(self) -> int | None:
        """Whitespace characters allowed between the tokens of JSON under a json_schema: None any
        number, 0 none (compact JSON), n at most n in a row."""
        if self.constrained_json_disable_any_whitespace:
            return 0
        if self.constrained_json_whitespace_pattern is not None:
            return json_whitespace_bound(self.constrained_json_whitespace_pattern)
        return None if self.constrained_json_max_whitespace == -1 else self.constrained_json_max_whitespace

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens one step may prefill (chunking off: effectively unbounded)."""
        return self.chunked_prefill_size if self.chunked_prefill_size != -1 else 1 << 62


def json_whitespace_bound(pattern: str) -> int | None:
    """The bound SGLang's whitespace pattern sets: n for [chars]{0,n}, None (any) for [chars]*.
    The characters must be JSON whitespace; xgrammar allows all four wherever one is allowed.
    Raises ValueError naming the flag for any other pattern."""
    match = _JSON_WHITESPACE_PATTERN.fullmatch(pattern)
    if match is None:
        raise ValueError(f"constrained_json_whitespace_pattern must be [chars]{{0,n}} or [chars]* with chars among "
                         f"space, \\n, \\t, \\r and \\s (xgrammar bounds the count, not the pattern), got {pattern!r}")
    return None if match["n"] is None else int(match["n"])

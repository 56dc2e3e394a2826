"""How a ModelRunner's parts are built at start (none of this runs per step).

The order matters and ModelRunner.__init__ keeps it: the device and the tensor-parallel
group first, then the model (its matmul dtype and packed weights), the KV pool sized by
the memory the weights left, the attention backend over it, and then the optional parts:
the quantized pool's start-up check (before graph capture, which folds fp8's scales in),
the host and disk tiers, the decode CUDA graphs and the quality spot checks' reference.
Functions that reduce over the ranks (Ranks) are called by every rank in the same order.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixrt.config import ServerArgs
from radixrt.config_views import PoolConfig, TierConfig
from radixrt.kernels import AttentionBackend, PagedKVCache, create_attention_backend
from radixrt.kernels.flashinfer_backend import FlashInferBackend
from radixrt.kernels.quant_weights import tile_kernels
from radixrt.models import ModelConfig, load_model
from radixrt.models.checkpoint_quant import weight_scheme
from radixrt.models.cpu_matmul import (
    MatmulChoice,
    PackingChoice,
    choose_matmul_dtype,
    choose_weight_packing,
    hold_linear_weights_in,
    pack_linear_weights,
)
from radixrt.models.dtype import resolve_dtype
from radixrt.models.int8_linear import (
    CANDIDATES,
    SPLIT_ROWS,
    Int8Choice,
    choose_int8_kernel,
)
from radixrt.models.lora import LoraBank
from radixrt.models.parallel import TPGroup, rank_heads
from radixrt.models.quant_linear import agree_routes
from radixrt.models.weight_quant import use_int8_kernel
from radixrt.settings.kv import rotates_keys
from radixrt.settings.quant import WeightScheme
from radixrt.worker.cuda_graph import DecodeGraphRunner, capture_sizes
from radixrt.worker.kv_calibration import (
    PrecisionReport,
    calibration_prompts,
    check_quantized_pool,
)
from radixrt.worker.kv_pool import plan_num_pages
from radixrt.worker.kv_tiers import (
    KVTierStore,
    plan_host_pages,
    prepare_disk_dir,
    tier_files,
    weights_fingerprint,
)
from radixrt.worker.ranks import Ranks
from radixrt.worker.spot_check import SpotChecker

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# tokens of a quality spot check per message: a live request that arrives waits for one such chunk at most
SPOT_CHECK_CHUNK = 512
AttentionOver = Callable[[PagedKVCache], AttentionBackend]  # a backend of the serving kind over another pool


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def init_tensor_parallel(args: ServerArgs, rank: int, dist_init: str, device: torch.device) -> TPGroup:
    if args.tp_size == 1:
        return TPGroup()
    backend = "nccl" if device.type == "cuda" else "gloo"
    torch.distributed.init_process_group(backend, init_method=dist_init, rank=rank, world_size=args.tp_size)
    return TPGroup(rank, args.tp_size)


def cpu_threads(args: ServerArgs) -> int:
    """This CPU worker's threads: the cores the process may run on (its affinity mask, which
    taskset, cgroups' cpusets and container limits set), shared among the node's ranks."""
    return max(1, len(os.sched_getaffinity(0)) // (args.tp_size // args.nnodes))


def place(args: ServerArgs, rank: int) -> torch.device:
    """This rank's device, with the process set up for it: its GPU on its node, or its CPU threads."""
    device = resolve_device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank % (args.tp_size // args.nnodes))
    if device.type == "cpu":
        torch.set_num_threads(cpu_threads(args))
        logger.info("worker %d: %d threads on cores %s", rank, torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
    return device


def model_shape(args: ServerArgs, device: torch.device) -> tuple[ModelConfig, torch.dtype, int]:
    """The checkpoint's config, the dtype it computes in here, and the context length served."""
    cfg = ModelConfig.from_dir(args.model_path)
    dtype = DTYPES[resolve_dtype(cfg.torch_dtype, cfg.model_type, device.type, args.dtype)]
    context_length = args.context_length or cfg.max_position_embeddings
    if context_length > cfg.max_position_embeddings:
        raise ValueError(
            f"context_length {context_length} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}"
        )
    return cfg, dtype, context_length


def load_for_serving(args: ServerArgs, cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
                     ranks: Ranks) -> tuple[torch.nn.Module, MatmulChoice, PackingChoice, QuantChoice]:
    """The model, with its linear layers quantized, held and packed as the ranks agreed to compute them."""
    scheme = weight_scheme(args.quantization, args.torchao_config, cfg.raw.get("quantization_config"))
    model = load_model(args.model_path, cfg, dtype, device, ranks.tp, scheme)
    quant = quantized_kernels(model, scheme, dtype, device, ranks)
    matmul = ranks.matmul(choose_matmul_dtype(dtype, device, args.cpu_matmul_dtype))
    logger.info("linear layers compute in %s: %s", matmul.dtype, matmul.reason)
    if matmul.dtype != dtype:
        hold_linear_weights_in(model, matmul.dtype)
    packing = choose_weight_packing(matmul.dtype, device, args.cpu_weight_packing)
    logger.info("linear layers multiply %s: %s", "through oneDNN-packed weights" if packing.packed
                else "through torch's F.linear", packing.reason)
    if packing.packed:
        pack_linear_weights(model)
    return model, matmul, packing, quant


@dataclass(frozen=True)
class QuantChoice:
    scheme: str  # WeightScheme.name: "none", "w8a8_int8", "int8wo", "int4wo", "fp8" or "gguf" (the last two held in tiles)
    reason: str  # where the scheme came from and, for int8, which kernel and why


def quantized_kernels(model: torch.nn.Module, scheme: WeightScheme, dtype: torch.dtype, device: torch.device,
                      ranks: Ranks) -> QuantChoice:
    """Give an int8 model's layers the kernel rank 0 measured fastest (every rank multiplies alike); say
    what a GGUF file's layers are held as."""
    if scheme.name in ("gguf", "int4wo"):
        held = getattr(model, "quant_held", None)
        if held is None:
            return QuantChoice("none", f"{scheme.source}: dequantized to {dtype} at load")
        tied = "the tied embedding and lm_head held too, as one copy" if held[2] else f"the embedding and lm_head in {dtype}"
        how = "as the file quantizes them" if scheme.name == "gguf" else f"in 4 bits per {scheme.group} inputs"
        formats = ", ".join(f"{name} {count}" for name, count in held[3].items())
        if changed := agree_routes(model, ranks.share, tile_kernels()):
            logger.info("weights: %s layers routed by row count as rank 0 measured", ", ".join(changed))
        reason = (f"{scheme.source}: {held[0]} linear layers held {how} ({formats}; {held[1] / 2**20:.1f} MiB in all, "
                  f"int8 activations, kernels/quant_weights.py); {tied}")
        logger.info("weights: %s", reason)
        return QuantChoice(scheme.name, reason)
    if not scheme.int8:
        reason = scheme.source if scheme.name == "none" else f"{scheme.source}: dequantized to {dtype} at load"
        return QuantChoice(scheme.name, reason)
    choice = choose_int8_kernel(scheme.name, dtype, device)
    names = CANDIDATES[scheme.name]
    small, large = (names[i] for i in ranks.share([names.index(choice.kernel), names.index(choice.large or choice.kernel)]))
    if (small, large) != (choice.kernel, choice.large or choice.kernel):
        choice = Int8Choice(scheme.name, small, f"rank 0's choice ({choice.reason} here)", large)
    picked = small if large == small else f"{small} up to {SPLIT_ROWS} rows, {large} above"
    layers = use_int8_kernel(model, choice)
    moe = " (MoE experts stay in the model's dtype)" if getattr(model.cfg, "moe", None) is not None else ""
    reason = f"{scheme.source}; {layers} linear layers int8 but lm_head{moe}; kernel {picked}: {choice.reason}"
    logger.info("weights: %s", reason)
    return QuantChoice(scheme.name, reason)


HOST_LORA_COPIES = 64  # adapters' tensors kept in host memory without --max-loaded-loras (a miss reads the files)


def lora_bank(args: ServerArgs, model: torch.nn.Module, weight_scheme: str) -> LoraBank | None:
    """The model's LoRA slots under --enable-lora (models/lora.py), each start-up adapter checked
    against this model; None without LoRA. A base model whose weights are quantized is refused
    by name: the adapters add to full-precision layers only."""
    serving = args.lora
    if serving is None:
        return None
    if weight_scheme != "none":
        raise ValueError(f"--enable-lora cannot serve a quantized base model (its weights are {weight_scheme}): "
                         "radixrt's LoRA adds to full-precision base layers only")
    bank = LoraBank(model, serving.slots, serving.rank, serving.sites, serving.max_loaded or HOST_LORA_COPIES)
    for adapter in serving.adapters:  # a misfit (a module this model lacks) fails the start, naming it
        bank.load(0, adapter)
    logger.info("LoRA: %d slots of rank %d on %s (%.1f MiB)", serving.slots, serving.rank, ", ".join(serving.sites),
                bank.nbytes() / 2**20)
    return bank


def build_kv_pool(args: ServerArgs, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, ranks: Ranks,
                  context_length: int) -> tuple[PagedKVCache, int]:
    """(the paged KV pool, its bytes per token on this rank), as many pages on every rank."""
    _, _, _, kv_heads = rank_heads(cfg, ranks.tp)
    bytes_per_token = PagedKVCache.bytes_per_token(cfg.num_layers, kv_heads, cfg.head_dim, dtype, args.kv_cache_dtype)
    ranks_per_memory = ranks.tp.size if device.type == "cpu" else 1  # CPU ranks share the host's RAM
    num_pages = ranks.fewest(plan_num_pages(PoolConfig.of(args), bytes_per_token, device, context_length, ranks_per_memory))
    cache = PagedKVCache(cfg.num_layers, num_pages, args.page_size, kv_heads, cfg.head_dim, dtype, device,
                         args.kv_cache_dtype, rotates_keys(args.kv_cache_dtype, args.kv_cache_rotation))
    return cache, bytes_per_token


def attention_over(backend: str, pool: PagedKVCache, cfg: ModelConfig, tp: TPGroup) -> AttentionBackend:
    """An attention backend of kind `backend` over pool, for this rank's heads."""
    _, heads, _, _ = rank_heads(cfg, tp)
    return create_attention_backend(backend, pool, heads, cfg.head_dim, cfg.attention_layers())


def check_quantized_kv(args: ServerArgs, model: torch.nn.Module, attn: AttentionBackend,
                       over: AttentionOver) -> PrecisionReport:
    """Fit fp8 scales and compare quantized KV with model-dtype KV; refuse to start when too far."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
    prompts = calibration_prompts(tokenizer, args.kv_calibration_file)
    return check_quantized_pool(model, attn, over, prompts, args.kv_scales_file, args.kv_quant_min_agreement)


def kv_fingerprint(args: ServerArgs, dtype: torch.dtype, cache: PagedKVCache, model_path: str) -> str:
    """The loaded weights' KV fingerprint: what the disk tier's directory is named by."""
    fp8_scales = cache.k_scale + cache.v_scale if cache.layer_scaled else None
    return weights_fingerprint(TierConfig.of(args), dtype, fp8_scales, model_path)


def tier_store(args: ServerArgs, rank: int, cache: PagedKVCache, bytes_per_token: int, fingerprint: str,
               device: torch.device) -> KVTierStore | None:
    """Host pages (hierarchical cache or swap space) and the disk tier, checked against what this machine has."""
    tiers = TierConfig.of(args)
    page_bytes = bytes_per_token * tiers.page_size
    host_pages = plan_host_pages(tiers, cache.num_pages, page_bytes, device)
    if not host_pages:
        return None
    disk_dir, disk_pages = None, 0
    if tiers.hicache_dir is not None or tiers.mooncake is not None:
        disk_dir, disk_pages = prepare_disk_dir(tiers, fingerprint, page_bytes)
    where = f"the Mooncake store at {tiers.mooncake.master}, keys " if tiers.mooncake is not None else ""
    logger.info("host KV tier: %d pages%s", host_pages,
                f"; below it: {disk_pages} pages in {where}{disk_dir}" if disk_dir else "")
    files = tier_files(tiers)
    store = KVTierStore(cache, host_pages, disk_dir, disk_pages, rank, tiers.hicache_disk_max_errors, files,
                        tiers.prefetch_timeout)
    if files is not None and store.disk is not None and files.store is None:  # no master now: off until it answers
        store.disk.turn_off(f"the Mooncake master at {tiers.mooncake.master} cannot be reached")
    return store


def capture_decode_graphs(args: ServerArgs, model: torch.nn.Module, attn: AttentionBackend, device: torch.device,
                          max_pages_per_req: int) -> DecodeGraphRunner | None:
    """CUDA graphs need FlashInfer's fixed-buffer decode wrappers; every rank captures the same sizes."""
    if args.disable_cuda_graph or device.type != "cuda" or not isinstance(attn, FlashInferBackend):
        return None
    start = time.perf_counter()
    sizes = capture_sizes(min(args.cuda_graph_max_bs, args.max_running_requests))
    graphs = DecodeGraphRunner(model, attn, sizes, max_pages_per_req=max_pages_per_req)
    logger.info("captured %d decode CUDA graphs (batch %d to %d) in %.1f s", len(sizes), sizes[0], sizes[-1],
                time.perf_counter() - start)
    return graphs


def spot_checker(args: ServerArgs, model: torch.nn.Module, cache: PagedKVCache, dtype: torch.dtype,
                 device: torch.device, context_length: int, over: AttentionOver) -> SpotChecker | None:
    """The quality spot checks' reference: a scratch pool in the model's dtype, one context long
    (None: spot checks are off)."""
    if args.quality_spot_check_rate <= 0:
        return None
    layers, kv_heads, head_dim = len(cache.k), cache.num_kv_heads, cache.head_dim  # the serving pool's
    pages = math.ceil(context_length / args.page_size)
    pool = PagedKVCache(layers, pages, args.page_size, kv_heads, head_dim, dtype, device)
    logger.info("quality spot checks: a %s reference pool of %d pages (%.1f MiB)", dtype, pages,
                sum(b.nbytes for b in pool.buffers) / 2**20)
    return SpotChecker(model, over(pool), min(args.prefill_chunk, SPOT_CHECK_CHUNK))

"""`radixrt estimate`: the memory one device needs for a model and a workload, from the checkpoint's
config.json and safetensors headers alone (no weight is read).

Per device (one tensor-parallel rank):

    total = weights + KV pool + page table + activation reserve (+ LoRA adapter slots)

  * weights: every checkpoint tensor's elements at the resolved dtype, this rank's share of it;
  * KV pool: `PagedKVCache.bytes_per_token` x the pool's tokens, through `pool_bytes` (padding page
    included), the worker's own formulas (radixrt/worker/kv_pool.py). The pool is what
    `--max-total-tokens` fixes, else the workload's: max_running_requests requests (the expected
    concurrency) of ceil(avg_seq_len / page_size) pages each, plus a 20% margin (KV_MARGIN);
  * page table: `page_table_bytes(max_running_requests, context_length, page_size)`, what the
    worker allocates beside the pool: 8 bytes per page of the context per request slot, a visible
    share of the pool (a few %) with page size 1, contexts far above avg_seq_len and small KV;
  * LoRA adapter slots (--enable-lora): A and B of every --max-loras-per-batch slot at the pool's
    rank on each fused layer adapters may target, this rank's shard (models/lora.lora_pool_bytes);
  * activation reserve: ACTIVATION_FRACTION (12%) of this rank's weights, for activations, the
    sampler, CUDA graphs and allocator slack. A rule of thumb (operators use 10-15%) that belongs
    to the estimate only: the server reserves nothing by this name; on CUDA it keeps
    1 - mem_fraction_static (12% by default) of the device outside weights and pool.

A configuration fits when total x (ranks sharing the memory) <= `--mem-gb` (GiB, 2**30 bytes, as
the server's --hicache-size): on CUDA each rank has its device, on CPU every rank shares the host.

Approximations:
  * tensor-parallel shares come from the tensor names (LlamaForCausalLM._shard_plan and
    rank_heads): k/v projections keep this rank's KV heads (replicated when there are fewer KV
    heads than ranks), a fused qkv_proj its q and KV heads, norms, MoE routers and row-parallel
    biases (o_proj, down_proj) are replicated, and every other tensor (q/o projections, MLP and
    experts, embeddings, lm_head) is split evenly. An architecture that shards otherwise is
    approximated by this rule;
  * on CPU a half-precision model may hold its linear layers in float32 (cpu_matmul.py, decided by
    a measurement at start), up to doubling the weights, and the linear layers may hold a second,
    oneDNN-packed copy of their weights (--cpu-weight-packing); the estimate counts the model's
    dtype, once;
  * a request's KV is ceil(avg_seq_len / page_size) pages: the average of the ceilings of a mixed
    workload can be up to a page more per request (the margin covers it when pages are short);
  * the host tier for `--reusable-prefix-tokens` is whole pool pages (the tier copies pages), per rank.

--model-path is a local checkpoint directory: a Hugging Face repo id is not resolved here. A GGUF
file is read through its sidecar directory (utils/gguf_sidecar.py, built on first use as a server
start builds it), its tensors' shapes from the file's header: served dequantized, they count at
the resolved dtype like any other checkpoint's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from radixrt.config import ServerArgs
from radixrt.launch_server import OneLineParser
from radixrt.models.config import ModelConfig
from radixrt.models.dtype import resolve_dtype
from radixrt.models.gguf_checkpoint import gguf_tensor_meta
from radixrt.ops.sizing import ACTIVATION_FRACTION, KV_MARGIN, Breakdown, Sizer, Workload
from radixrt.ops.trace import load_trace
from radixrt.settings.kv import KV_FORMAT_NAMES as KV_CACHE_DTYPES
from radixrt.settings.kv import check_head_dim
from radixrt.utils.checkpoint_meta import TensorMeta, checkpoint_tensors, read_config
from radixrt.utils.gguf_sidecar import ensure_sidecar, gguf_source, is_gguf_file
from radixrt.worker.kv_pool import available_host_bytes
from radixrt.worker.runner_setup import DTYPES, resolve_device

GIB = 2**30
# ServerArgs fields that size memory: `radixrt estimate` takes them with the server's flags and defaults
SIZING_FIELDS = (
    "model_path", "dtype", "device", "kv_cache_dtype", "page_size", "tp_size", "context_length",
    "max_running_requests", "max_total_tokens",
    "enable_lora", "lora_paths", "max_lora_rank", "lora_target_modules", "max_loras_per_batch",
)  # fmt: skip


@dataclass(frozen=True)
class KVDtypeRow:
    """One kv_cache_dtype at the estimate's tp size: its pool for the workload and the largest
    concurrency (max_running_requests) whose workload fits the memory."""

    bytes_per_token: int
    kv_pool_bytes: int
    total_bytes: int
    max_concurrency: int


@dataclass(frozen=True)
class Estimate:
    """The estimate for one configuration; `breakdown` is what the server would allocate per rank."""

    model_path: str
    device: str
    dtype: str
    kv_cache_dtype: str
    tp_size: int
    page_size: int
    context_length: int
    max_running_requests: int
    avg_seq_len: float
    mem_bytes: int
    breakdown: Breakdown
    workload_kv_bytes: int  # the workload's pool (with margin), whatever --max-total-tokens fixed
    requests_in_pool: int  # average requests the pool holds at once
    fits: bool
    kv_dtypes: dict[str, KVDtypeRow]
    min_tp_size: int | None  # None: no tp size up to num_attention_heads fits (offload)
    reusable_prefix_tokens: int
    host_tier_bytes: int
    lora_rank: int = 0  # the adapter slots' rank (0: no --enable-lora)

    def to_json(self) -> dict:
        """The fields, the breakdown's flattened in (get_server_info's key names), and totals."""
        out = dataclasses.asdict(self)
        out.update(out.pop("breakdown"), total_bytes=self.breakdown.total_bytes)
        out["hicache_size_gb"] = self.host_tier_bytes / GIB
        return out


def estimate(args: ServerArgs, workload: Workload, mem_bytes: int | None = None) -> Estimate:
    """The estimate for the server started with args, serving args.max_running_requests concurrent
    requests of the workload, on devices of mem_bytes each (None: this machine's). Reads config.json
    and the safetensors headers only. Raises ValueError for a directory that is not a checkpoint,
    a context_length above the model's, or a model that does not split over args.tp_size."""
    model_dir = checkpoint_dir(args.model_path)
    read_config(model_dir)  # the refusal of a directory without config.json, naming it
    cfg = ModelConfig.from_dir(model_dir)
    device = resolve_device(args.device).type
    dtype = resolve_dtype(cfg.torch_dtype, cfg.model_type, device, args.dtype)
    context = args.context_length or cfg.max_position_embeddings
    if context > cfg.max_position_embeddings:
        raise ValueError(
            f"context_length {context} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}"
        )
    mem = mem_bytes if mem_bytes is not None else device_memory(device)
    sizer = Sizer(cfg, tensor_meta(model_dir), DTYPES[dtype], device, args.page_size, context, mem, args.lora)
    ps, tp, concurrency = args.page_size, args.tp_size, args.max_running_requests
    workload_pages = workload.pages(concurrency, ps)
    pages = args.max_total_tokens // ps if args.max_total_tokens is not None else workload_pages  # as plan_num_pages
    b = sizer.breakdown(tp, args.kv_cache_dtype, concurrency, pages)
    check_head_dim(args.kv_cache_dtype, cfg.head_dim)  # the setting asked for: refused by name, as the server would
    kv_dtypes = [kv for kv in dict.fromkeys((*KV_CACHE_DTYPES, args.kv_cache_dtype)) if takes(kv, cfg.head_dim)]
    rows = {kv: kv_dtype_row(sizer, tp, kv, concurrency, workload) for kv in kv_dtypes}
    return Estimate(
        model_path=str(args.model_path), device=device, dtype=dtype, kv_cache_dtype=args.kv_cache_dtype, tp_size=tp,
        page_size=ps, context_length=context, max_running_requests=concurrency, avg_seq_len=workload.avg_seq_len,
        mem_bytes=mem, breakdown=b, workload_kv_bytes=rows[args.kv_cache_dtype].kv_pool_bytes,
        requests_in_pool=workload.requests_in(pages, ps), fits=sizer.fits(b, tp), kv_dtypes=rows,
        min_tp_size=sizer.min_tp_size(args.kv_cache_dtype, concurrency, pages),
        reusable_prefix_tokens=workload.reusable_prefix_tokens,
        host_tier_bytes=math.ceil(workload.reusable_prefix_tokens / ps) * ps * b.bytes_per_token,  # whole pages
        lora_rank=args.lora.rank if args.lora is not None else 0,
    )


def checkpoint_dir(model_path: str) -> Path:
    """The directory config.json and the tokenizer are read from: model_path, or a GGUF file's sidecar."""
    return ensure_sidecar(model_path) if is_gguf_file(model_path) else Path(model_path)


def tensor_meta(model_dir: Path) -> dict[str, TensorMeta]:
    """The checkpoint's tensors by name: safetensors headers, or a GGUF sidecar's file header."""
    return gguf_tensor_meta(model_dir) if gguf_source(model_dir) is not None else checkpoint_tensors(model_dir)


def takes(kv_dtype: str, head_dim: int) -> bool:
    """Whether the pool can store this model's heads in kv_dtype (int4 needs head_dim a multiple of 32)."""
    try:
        check_head_dim(kv_dtype, head_dim)
    except ValueError:
        return False
    return True


def kv_dtype_row(sizer: Sizer, tp_size: int, kv_dtype: str, concurrency: int, workload: Workload) -> KVDtypeRow:
    b = sizer.breakdown(tp_size, kv_dtype, concurrency, workload.pages(concurrency, sizer.page_size))
    most = sizer.max_concurrency(tp_size, kv_dtype, workload)
    return KVDtypeRow(b.bytes_per_token, b.kv_pool_bytes, b.total_bytes, most)


def device_memory(device: str) -> int:
    """This machine's memory for one rank: the GPU's total, or the host's available RAM."""
    return torch.cuda.get_device_properties(0).total_memory if device == "cuda" else available_host_bytes()


def trace_avg_seq_len(trace: Path, tokenizer_path: str) -> float:
    """Average prompt + output tokens of a trace in `radixrt tune`'s format (radixrt/ops/trace.py);
    text prompts are tokenized as the server does. Raises TraceError (a ValueError) naming the bad line."""
    requests, tokenizer = load_trace(trace), None
    total = 0
    for r in requests:
        if r.input_ids is not None:
            total += len(r.input_ids)
        else:
            if tokenizer is None:
                from transformers import AutoTokenizer  # only for text prompts

                tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
            total += len(tokenizer.encode(r.prompt, add_special_tokens=True))
        total += r.output_len
    return total / len(requests)


def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def table(e: Estimate) -> str:
    """The estimate as the operator reads it."""
    b = e.breakdown
    share = b.page_table_bytes / b.kv_pool_bytes
    lines = [
        f"{e.model_path}: {e.dtype} on {e.device}, tp {e.tp_size}, page size {e.page_size}, context {e.context_length}",
        f"workload: {e.max_running_requests} x {e.avg_seq_len:.1f} tokens (the pool holds {e.requests_in_pool})",
        "",
        "per device",
        *(f"  {label:<26}{human(n):>12}   {note}".rstrip() for label, n, note in (
            ("weights", b.weight_bytes, ""),
            (f"KV cache ({e.kv_cache_dtype})", b.kv_pool_bytes,
             f"{b.num_pages} pages x {e.page_size} tokens x {b.bytes_per_token} B/token"),
            ("page table", b.page_table_bytes, f"{share:.1%} of the KV cache"),
            ("activation reserve", b.activation_bytes, f"{ACTIVATION_FRACTION:.0%} of the weights"),
            *((("LoRA adapter slots", b.lora_bytes, f"--max-loras-per-batch slots of rank {e.lora_rank}"),)
              if b.lora_bytes else ()),
            ("total", b.total_bytes, f"of {human(e.mem_bytes)}: " + ("fits" if e.fits else "does not fit")),
        )),  # fmt: skip
        "",
        f"at each kv dtype: the workload's KV cache (+{float(KV_MARGIN - 1):.0%}) and the most requests that fit",
        f"  {'kv dtype':<10}{'B/token':>9}{'KV cache':>13}{'total':>13}{'max concurrency':>17}",
    ]
    for kv, r in e.kv_dtypes.items():
        pool, total = human(r.kv_pool_bytes), human(r.total_bytes)
        lines.append(f"  {kv:<10}{r.bytes_per_token:>9}{pool:>13}{total:>13}{r.max_concurrency:>17}")
    lines += ["", f"smallest tp size that fits: {e.min_tp_size or 'none (offload)'}"]
    if e.reusable_prefix_tokens:
        gib = math.ceil(e.host_tier_bytes / GIB * 100) / 100  # rounded up: the tier must hold them all
        lines.append(f"host tier for {e.reusable_prefix_tokens} reusable prefix tokens: "
                     f"{human(e.host_tier_bytes)} per rank (--hicache-size {gib:.2f})")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="radixrt estimate", description="Memory per device for a model and a workload.")
    fields = {f.name: f for f in dataclasses.fields(ServerArgs)}
    for name in SIZING_FIELDS:  # the server's own flags, defaults and help
        f, flag = fields[name], "--" + name.replace("_", "-")
        if str(f.type) == "bool":
            parser.add_argument(flag, action="store_true", help=f.metadata["help"])
        elif str(f.type).startswith("list"):
            parser.add_argument(flag, nargs="*", default=None, help=f.metadata["help"])
        else:
            kind = int if str(f.type).startswith("int") else str
            parser.add_argument(flag, type=kind, default=f.default, help=f.metadata["help"], required=name == "model_path")
    workload = parser.add_mutually_exclusive_group(required=True)
    workload.add_argument("--avg-seq-len", type=float, help="average prompt + output tokens of a request")
    workload.add_argument("--trace", type=Path, help="JSONL trace, as radixrt tune reads it: one "
                          "{arrival, prompt|input_ids, output_len} per line")
    parser.add_argument("--mem-gb", type=float, help="GiB of one device (default: this machine's GPU or available RAM)")
    parser.add_argument("--reusable-prefix-tokens", type=int, default=0, help="prefix tokens to hold in a host tier")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def main(argv: list[str]) -> int:
    """Exit status 0, or 2 with a one-line error for a bad flag or checkpoint."""
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        args = ServerArgs(**{name: getattr(ns, name) for name in SIZING_FIELDS})
        avg = ns.avg_seq_len if ns.trace is None else trace_avg_seq_len(ns.trace, str(checkpoint_dir(args.model_path)))
        mem = round(ns.mem_gb * GIB) if ns.mem_gb is not None else None
        e = estimate(args, Workload(avg, ns.reusable_prefix_tokens), mem)
    except (ValueError, OSError) as err:
        parser.error(str(err))
    print(json.dumps(e.to_json(), indent=2) if ns.json else table(e))
    return 0

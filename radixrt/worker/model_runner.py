"""ModelRunner: turns one ForwardBatch into one model forward, sampled ids and logprobs.

Owns the model, the paged KV cache, the per-slot page tables (grown by the
deltas the scheduler sends), the sampler and, on CUDA with FlashInfer, the
decode CUDA graphs (cuda_graph.py). The per-step work here is tensor building
from the batch (O(batch) Python), the forward (replayed from a graph for decode
batches up to the largest captured size), and sampling.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch

from radixrt.config import ServerArgs
from radixrt.kernels import (
    AttentionBackend, AttentionMetadata, PagedKVCache, create_attention_backend, default_attention_backend
)
from radixrt.kernels.flashinfer_backend import FlashInferBackend
from radixrt.messages import (
    BatchEntry, BatchResult, EntryError, EntryLogprobs, ForwardBatch, KVMove, SpotCheck, SpotCheckResult, WeightsLoaded,
    WorkerReady
)
from radixrt.models import ModelConfig, load_model, reload_weights
from radixrt.models.cpu_matmul import (
    MatmulChoice,
    choose_matmul_dtype,
    choose_weight_packing,
    hold_linear_weights_in,
    pack_linear_weights,
)
from radixrt.models.dtype import resolve_dtype
from radixrt.models.llama import rank_heads
from radixrt.models.parallel import TPGroup
from radixrt.worker.cuda_graph import DecodeGraphRunner, capture_sizes
from radixrt.utils.checkpoint_meta import incompatibility
from radixrt.worker.kv_calibration import KVCalibrationError, PrecisionReport, calibration_prompts, check_quantized_pool
from radixrt.worker.kv_pool import PAGE_TABLE_DTYPE, page_table_shape, plan_num_pages
from radixrt.worker.kv_tiers import KVTierStore, plan_host_pages, prepare_disk_dir, weights_fingerprint
from radixrt.worker.logprobs import LogitRows, entry_logprobs
from radixrt.worker.memory_figures import MemoryFigures
from radixrt.worker.retention_tensors import RetentionSlots, gather_mass, refusals
from radixrt.worker.sampler import Sampler, mask_disallowed
from radixrt.worker.spot_check import SpotChecker

logger = logging.getLogger(__name__)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# tokens of a quality spot check per message: a live request that arrives waits for one such chunk at most
SPOT_CHECK_CHUNK = 512


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


class ModelRunner:
    def __init__(self, args: ServerArgs, rank: int = 0, dist_init: str = "") -> None:
        self.device = device = resolve_device(args.device)
        if device.type == "cuda":
            torch.cuda.set_device(rank % (args.tp_size // args.nnodes))  # the rank's GPU on its node
        if device.type == "cpu":
            torch.set_num_threads(cpu_threads(args))
            logger.info("worker %d: %d threads on cores %s", rank, torch.get_num_threads(), sorted(os.sched_getaffinity(0)))
        self.tp = init_tensor_parallel(args, rank, dist_init, device)
        torch.manual_seed(args.random_seed)  # unseeded sampling draws from this
        self.args = args
        self.model_path = args.model_path  # the checkpoint now loaded (a weight update changes it)
        self.cfg = cfg = ModelConfig.from_dir(args.model_path)
        self.dtype = dtype = DTYPES[resolve_dtype(cfg.torch_dtype, cfg.model_type, device.type, args.dtype)]
        self.context_length = args.context_length or cfg.max_position_embeddings
        if self.context_length > cfg.max_position_embeddings:
            raise ValueError(
                f"context_length {self.context_length} exceeds the model's max_position_embeddings {cfg.max_position_embeddings}"
            )
        self.model = load_model(args.model_path, cfg, dtype, device, self.tp)
        self.matmul = self._agree_matmul(choose_matmul_dtype(dtype, device, args.cpu_matmul_dtype))
        logger.info("linear layers compute in %s: %s", self.matmul.dtype, self.matmul.reason)
        if self.matmul.dtype != dtype:
            hold_linear_weights_in(self.model, self.matmul.dtype)
        self.packing = choose_weight_packing(self.matmul.dtype, device, args.cpu_weight_packing)
        logger.info("linear layers multiply %s: %s", "through oneDNN-packed weights" if self.packing.packed
                    else "through torch's F.linear", self.packing.reason)
        self._pack_weights()
        _, heads, _, kv_heads = rank_heads(cfg, self.tp)
        self.bytes_per_token = PagedKVCache.bytes_per_token(cfg.num_layers, kv_heads, cfg.head_dim, dtype, args.kv_cache_dtype)
        ranks_per_memory = self.tp.size if device.type == "cpu" else 1  # CPU ranks share the host's RAM
        num_pages = self._agree(plan_num_pages(args, self.bytes_per_token, device, self.context_length, ranks_per_memory))
        self.cache = PagedKVCache(
            cfg.num_layers, num_pages, args.page_size, kv_heads, cfg.head_dim, dtype, device, args.kv_cache_dtype
        )
        self.backend_name = backend = args.attention_backend or default_attention_backend(device.type)
        self.attn = create_attention_backend(backend, self.cache, heads, cfg.head_dim, cfg.attention_layers())
        self.page_size = args.page_size
        slots = args.max_running_requests
        # page_table[slot, i]: the i-th page of the request on that slot
        self.page_table = torch.zeros(
            page_table_shape(slots, self.context_length, args.page_size), dtype=PAGE_TABLE_DTYPE, device=device
        )
        self.pages_used = [0] * slots
        self.retention_refusals = refusals(self.model, self.attn, args.kv_retention)
        self.retention = RetentionSlots(self.cache, self.model, self.page_table)
        # longrope: a request runs under the short or the long rope factors, as the scheduler says
        self.long_rope = self.model.rope if self.model.rope.long_from is not None else None
        self.long_slots = [False] * slots  # per slot, set when its request starts
        self.kv_check: PrecisionReport | None = None  # the quantized pool's start-up check
        if self.cache.quantized:  # before graph capture: fp8's scales are folded in there
            self.kv_check = self._check_quantized_kv()
        self.fingerprint = self._fingerprint()  # after the check: it covers fp8's scales
        self.tiers = self._tier_store(args, rank)
        self.graphs = self._capture_decode_graphs(args)
        self.sampler = Sampler(slots, cfg.vocab_size, device)
        self.spot = self._spot_checker(args) if args.quality_spot_check_rate > 0 else None
        self.memory = MemoryFigures(device)
        logger.info("worker ready: %s on %s, %d pages of %d tokens", cfg.model_type, device, num_pages, args.page_size)

    def _check_quantized_kv(self) -> PrecisionReport:
        """Fit fp8 scales and compare quantized KV with model-dtype KV; refuse to start when too far."""
        from transformers import AutoTokenizer

        args, cfg = self.args, self.cfg
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        prompts = calibration_prompts(tokenizer, args.kv_calibration_file)
        return check_quantized_pool(self.model, self.attn, self._attention_over, prompts, args.kv_scales_file,
                                    args.kv_quant_min_agreement)

    def _attention_over(self, pool: PagedKVCache) -> AttentionBackend:
        """An attention backend of the serving one's kind over another pool (the quantized pool's
        start-up check, the spot checks' reference)."""
        return create_attention_backend(self.backend_name, pool, self.attn.num_heads, self.cfg.head_dim,
                                        self.cfg.attention_layers())

    def _spot_checker(self, args: ServerArgs) -> SpotChecker:
        """The quality spot checks' reference: a scratch pool in the model's dtype, one context long."""
        layers, (_, _, kv_heads, head_dim) = len(self.cache.k), self.cache.k[0].shape  # the serving pool's
        pages = math.ceil(self.context_length / args.page_size)
        pool = PagedKVCache(layers, pages, args.page_size, kv_heads, head_dim, self.dtype, self.device)
        logger.info("quality spot checks: a %s reference pool of %d pages (%.1f MiB)", self.dtype, pages,
                    sum(b.nbytes for b in pool.buffers) / 2**20)
        return SpotChecker(self.model, self._attention_over(pool), min(args.prefill_chunk, SPOT_CHECK_CHUNK))

    def spot_check(self, msg: SpotCheck) -> SpotCheckResult:
        """One chunk of a quality spot check (every rank runs it; rank 0's answer counts)."""
        if self.spot is None:
            return SpotCheckResult(msg.check_id, True, error="this worker has no spot-check pool")
        result = self.spot.run(msg)
        result.memory = self.memory.due()
        return result

    def _fingerprint(self) -> str:
        """The loaded weights' KV fingerprint: what the disk tier's directory is named by."""
        fp8_scales = self.cache.k_scale + self.cache.v_scale if self.cache.layer_scaled else None
        return weights_fingerprint(self.args, self.dtype, fp8_scales, self.model_path)

    def _capture_decode_graphs(self, args: ServerArgs) -> DecodeGraphRunner | None:
        """CUDA graphs need FlashInfer's fixed-buffer decode wrappers; every rank captures the same sizes."""
        if args.disable_cuda_graph or self.device.type != "cuda" or not isinstance(self.attn, FlashInferBackend):
            return None
        start = time.perf_counter()
        sizes = capture_sizes(min(args.cuda_graph_max_bs, args.max_running_requests))
        graphs = DecodeGraphRunner(self.model, self.attn, sizes, max_pages_per_req=self.page_table.shape[1])
        logger.info("captured %d decode CUDA graphs (batch %d to %d) in %.1f s", len(sizes), sizes[0], sizes[-1],
                    time.perf_counter() - start)
        return graphs

    def _tier_store(self, args: ServerArgs, rank: int) -> KVTierStore | None:
        """Host pages (hierarchical cache or swap space) and the disk tier, checked against what this machine has."""
        page_bytes = self.bytes_per_token * args.page_size
        host_pages = plan_host_pages(args, self.cache.num_pages, page_bytes, self.device)
        if not host_pages:
            return None
        disk_dir, disk_pages = None, 0
        if args.hicache_dir is not None:
            disk_dir, disk_pages = prepare_disk_dir(args, self.fingerprint, page_bytes)
        logger.info("host KV tier: %d pages%s", host_pages, f"; disk tier: {disk_pages} pages in {disk_dir}" if disk_dir else "")
        return KVTierStore(self.cache, host_pages, disk_dir, disk_pages, rank, args.hicache_disk_max_errors)

    def move(self, moves: list[KVMove]) -> None:
        """Run the scheduler's tier moves (before the forward that needs them). The ranks agree on
        which disk file operations failed: a page lost on any rank is lost on all."""
        assert self.tiers is not None, "KV tier moves without a host tier"
        self.tiers.run(moves)
        if self.tiers.disk is not None:  # every rank ran the same moves: as many outcomes, in the same order
            self.tiers.disk.settle(self._reduce_each(self.tiers.disk.outcomes(), torch.distributed.ReduceOp.MAX))

    # -- weight updates ----------------------------------------------------------------------

    def load_weights(self, model_path: str) -> WeightsLoaded:
        """Swap in the weights at model_path on every rank or on none. The scheduler sends this
        only with the pool drained and flushes the old KV after it. A quantized pool's check
        runs again (fp8 scales refit to the new weights); whatever fails on any rank rolls every
        rank back to the weights it had, and the reply says why."""
        why = incompatibility(self.model_path, model_path)  # the headers first: nothing is read on a misfit
        if (failed := self._first_failed_rank(why is not None)) is not None:
            return WeightsLoaded(False, why or f"rank {failed} refused {model_path}; see its log")
        why = self._try(lambda: self._reload(model_path), f"loading {model_path}")
        failed = self._first_failed_rank(why is not None)
        if failed is None and self.cache.quantized:
            why = self._try(self._recheck_quantized_kv, "the quantized KV check")
            failed = self._first_failed_rank(why is not None)
        if failed is not None:
            self._reload(self.model_path)  # NOTE: a failure here ends the worker
            if self.cache.quantized:
                self._recheck_quantized_kv()
            why = why or f"rank {failed} could not load {model_path}; see its log"
            return WeightsLoaded(False, f"{why}; the weights of {self.model_path} keep serving")
        self.model_path = model_path
        self.fingerprint = self._fingerprint()
        if self.graphs is not None and self.cache.layer_scaled:  # capture folded fp8's old scales in
            self.graphs = self._capture_decode_graphs(self.args)
        disk_dir, disk_pages = self._follow_with_disk_tier()
        logger.info("weights updated from %s (fingerprint %s)", model_path, self.fingerprint)
        return WeightsLoaded(True, "Succeeded to update model weights.", self.fingerprint, disk_dir, disk_pages)

    def _follow_with_disk_tier(self) -> tuple[str, int]:
        """The disk tier moves to the new weights' directory (and its capacity); ("", 0): none, or
        off. A directory that any rank cannot prepare turns the tier off: it is only a cache."""
        disk = self.tiers.disk if self.tiers is not None else None
        if disk is None or not disk.enabled:
            return "", 0
        page_bytes = self.bytes_per_token * self.page_size
        try:
            disk.dir, disk.capacity = prepare_disk_dir(self.args, self.fingerprint, page_bytes)
            why = None
        except ValueError as e:
            why = str(e)
        if self._first_failed_rank(why is not None) is not None:
            disk.turn_off(why or "another rank cannot use the new weights' directory")
            return "", 0
        return str(disk.dir), disk.capacity

    def _recheck_quantized_kv(self) -> None:
        self.kv_check = self._check_quantized_kv()

    @staticmethod
    def _try(fn, what: str) -> str | None:
        """Run fn; None, or why it failed (logged with its traceback)."""
        try:
            fn()
        except KVCalibrationError as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - reported to the caller, who rolls back
            logger.exception("%s failed", what)
            return f"{what} failed: {type(e).__name__}: {e}"
        return None

    def _first_failed_rank(self, failed: bool) -> int | None:
        """The lowest rank that failed (every rank passes its own flag and gets the same answer), or None."""
        # the lowest failed rank r sends the largest value, size - r
        top = self._reduce(self.tp.size - self.tp.rank if failed else 0, torch.distributed.ReduceOp.MAX)
        return self.tp.size - top if top else None

    def _reload(self, model_path: str) -> None:
        """The weights at model_path in place of the ones held, their packed copies with them."""
        reload_weights(self.model, model_path, self.device)
        self._pack_weights()

    def _pack_weights(self) -> None:
        """The linear layers' packed copies, made anew from the weights they hold (where chosen)."""
        if self.packing.packed:
            pack_linear_weights(self.model)

    def _agree_matmul(self, choice: MatmulChoice) -> MatmulChoice:
        """Every rank computes as the others do: float32 if any rank chose it (ranks of one host
        read the same flags, so they differ only where a measurement overrode them)."""
        upcast = self._reduce(int(choice.dtype == torch.float32), torch.distributed.ReduceOp.MAX)
        if upcast and choice.dtype != torch.float32:
            return MatmulChoice(torch.float32, f"another rank's choice ({choice.reason} here)")
        return choice

    def _agree(self, num_pages: int) -> int:
        """Every rank must hold the same pages: take the smallest pool any rank can afford."""
        return self._reduce(num_pages, torch.distributed.ReduceOp.MIN)

    def _reduce(self, value: int, op: torch.distributed.ReduceOp) -> int:
        """value reduced with op over the tensor-parallel ranks (every rank calls it, in the same order)."""
        return self._reduce_each([value], op)[0]

    def _reduce_each(self, values: list[int], op: torch.distributed.ReduceOp) -> list[int]:
        """values reduced elementwise with op over the ranks (every rank passes as many, in the same order)."""
        if self.tp.size == 1 or not values:
            return values
        t = torch.tensor(values, dtype=torch.int64, device=self.device)
        torch.distributed.all_reduce(t, op=op)
        return t.tolist()

    def ready_message(self) -> WorkerReady:
        return WorkerReady(
            num_pages=self.cache.num_pages,
            page_size=self.page_size,
            vocab_size=self.cfg.vocab_size,
            context_length=self.context_length,
            eos_ids=list(self.cfg.eos_ids),
            bytes_per_token=self.bytes_per_token,
            page_bytes=self.bytes_per_token * self.page_size,
            **(self.tiers.describe() if self.tiers is not None else {}),
            long_prompt_threshold=self.long_rope.long_from if self.long_rope is not None else 0,
            kv_pool_bytes=sum(b.nbytes for b in self.cache.buffers),
            page_table_bytes=self.page_table.nbytes,
            weight_bytes=sum(p.nbytes for p in self.model.parameters()),
            weights_fingerprint=self.fingerprint,
            retention_refusals=self.retention_refusals,
            memory=self.memory.read(),
            matmul_dtype=str(self.matmul.dtype).removeprefix("torch."),
            matmul_dtype_reason=self.matmul.reason,
            weight_packing="onednn" if self.packing.packed else "none",
            weight_packing_reason=self.packing.reason,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> BatchResult:
        """Run the batch. What one request's parameters break (its sampling state, its
        sample, its logprobs) fails that entry alone, reported in BatchResult.errors; an
        exception out of here (the model forward, the KV pool) is the worker's end.

        Every rank runs every entry's forward and page-table update, failed or not, so
        the ranks' KV stays in lockstep; failures only change what rank 0 answers."""
        failed = self._apply_slot_changes(batch)  # entry index -> why; grown by sampling and logprobs
        entries = batch.entries
        meta, input_ids, positions = self._prepare(entries)
        if self.graphs is not None and not meta.mass_reqs and self.graphs.can_run(meta):
            hidden = self.graphs.replay(meta, input_ids, positions)  # [T, hidden]
        else:
            self.attn.init_forward(meta)
            hidden = self.model(input_ids, positions, self.attn)  # [T, hidden]
        rows = LogitRows.plan(entries)
        logits = self.model.compute_logits(hidden[rows.index(self.device)])  # [R, vocab] float32
        page_mass = gather_mass(self.attn, entries, meta.mass_reqs, self.tp)  # every rank: an all-reduce
        disk = self.tiers.take_faults() if self.tiers is not None else None  # agreed: rank 0's stand for all
        if self.tp.rank != 0:  # the others took part in the forward and the logits gather; rank 0 samples
            return BatchResult(step=batch.step, next_ids=[])
        ids = self._sample(entries, rows, logits, failed)
        logprobs: list[EntryLogprobs | None] = []
        if rows.any_logprobs:
            logprobs = entry_logprobs(entries, rows, logits, ids, failed)
        moved = self.tiers.take_seconds() if self.tiers is not None else 0.0
        errors = [EntryError(i, failed[i]) for i in sorted(failed)]
        next_ids = [t for t in ids if t is not None]  # an entry that failed its sample has none
        return BatchResult(step=batch.step, next_ids=next_ids, logprobs=logprobs, move_seconds=moved, errors=errors,
                           page_mass=page_mass, memory=self.memory.due(), disk=disk)

    def _sample(
        self, entries: list[BatchEntry], rows: LogitRows, logits: torch.Tensor, failed: dict[int, str]
    ) -> list[int | None]:
        """Per entry its next id (None: no sample, or it failed: added to `failed`)."""
        ids: list[int | None] = [None] * len(entries)
        picks = [i for i, e in enumerate(entries) if e.sample and i not in failed]
        if not picks:
            return ids
        pos = [rows.entry_sample[i] for i in picks]
        picked = logits[pos]  # [S, vocab], a copy: the logprobs read the raw logits
        constrained = [k for k, i in enumerate(picks) if entries[i].allowed]
        if constrained:
            mask_disallowed(picked, constrained, [entries[picks[k]].allowed for k in constrained])
        res = self.sampler.sample_isolated(picked, [entries[i].slot for i in picks])
        for i, t in zip(picks, res.ids):
            ids[i] = t
        for row, why in res.errors.items():
            failed[picks[row]] = why
        return ids

    def _apply_slot_changes(self, batch: ForwardBatch) -> dict[int, str]:
        """Freed slots, copy-on-write copies, new slots' sampling state and page-table deltas.
        Returns the entries whose sampling state was refused (entry index -> why)."""
        for slot in batch.freed_slots:
            self.sampler.remove(slot)
            self.retention.forget(slot)
        self.retention.save_sinks(batch.entries)  # before a copy may overwrite a page a drop freed
        if batch.copy_src:
            src = torch.tensor(batch.copy_src, dtype=torch.int64, device=self.device)
            self.cache.copy_slots(src, torch.tensor(batch.copy_dst, dtype=torch.int64, device=self.device))
        rows, cols, pages = [], [], []
        failed: dict[int, str] = {}
        for i, e in enumerate(batch.entries):
            if e.init is not None:
                self.pages_used[e.slot] = 0
                self.long_slots[e.slot] = e.init.long_rope
                why = self._start_slot(e)
                if why is not None:
                    failed[i] = why
            if e.retain is not None:  # retention dropped pages: the whole table anew
                self.page_table[e.slot, : len(e.retain.pages)] = torch.tensor(e.retain.pages, dtype=self.page_table.dtype)
                self.pages_used[e.slot] = len(e.retain.pages)
            n = self.pages_used[e.slot]
            rows += [e.slot] * len(e.new_pages)
            cols += range(n, n + len(e.new_pages))
            pages += e.new_pages
            self.pages_used[e.slot] = n + len(e.new_pages)
        if pages:
            t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)  # noqa: E731
            self.page_table[t(rows), t(cols)] = t(pages)
        self.retention.shift_sinks(batch.entries)
        return failed

    def _start_slot(self, e: BatchEntry) -> str | None:
        """The entry's request starts on its slot: its sampling state, or why it was refused
        (the slot is then empty, and the scheduler frees it with the failed request)."""
        assert e.init is not None
        try:
            self.sampler.add(e.slot, e.init.sampling, e.init.penalty_ids, e.init.stop_ids, e.init.output_ids)
        except Exception as ex:  # the request's parameters (documented: ValueError)
            logger.exception("slot %d: the request's sampling state was refused", e.slot)
            self.sampler.remove(e.slot)
            return f"bad sampling state: {type(ex).__name__}: {ex}"
        return None

    def _prepare(self, entries: list[BatchEntry]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
        dev = self.device
        qo_lens = [len(e.input_ids) for e in entries]
        kv_lens = [e.start_pos + n for e, n in zip(entries, qo_lens)]
        input_ids = torch.tensor([t for e in entries for t in e.input_ids], dtype=torch.int64, device=dev)
        qo = torch.tensor(qo_lens, dtype=torch.int64, device=dev)
        starts = torch.tensor([e.start_pos for e in entries], dtype=torch.int64, device=dev)
        # output_size: the host knows T; without it repeat_interleave reads qo's sum back from the device
        req_of_row = torch.repeat_interleave(torch.arange(len(entries), device=dev), qo, output_size=len(input_ids))  # [T]
        first_row = torch.cumsum(qo, 0) - qo  # [B]
        positions = starts[req_of_row] + torch.arange(len(input_ids), device=dev) - first_row[req_of_row]  # [T]
        max_pages = math.ceil(max(kv_lens) / self.page_size)
        slots = torch.tensor([e.slot for e in entries], dtype=torch.int64, device=dev)
        page_table = self.page_table[slots, :max_pages]  # [B, max_pages]
        ps = self.page_size
        out_slots = page_table[req_of_row, positions // ps] * ps + positions % ps  # [T]
        positions, grew = self.retention.positions(entries, positions, req_of_row)  # cache index -> sequence
        if grew and self.graphs is not None:  # the rope tables moved: graphs captured the old ones
            self.graphs = self._capture_decode_graphs(self.args)
        if self.long_rope is not None:  # the model reads rope table rows: short or long factors per request
            long = torch.tensor([self.long_slots[e.slot] for e in entries], dtype=torch.bool, device=dev)
            positions = self.long_rope.table_rows(positions, long[req_of_row])
        mass_reqs = [i for i, e in enumerate(entries) if e.want_mass]
        return AttentionMetadata(qo_lens, kv_lens, page_table, out_slots, ps, mass_reqs), input_ids, positions

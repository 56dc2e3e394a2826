"""ModelRunner: turns one ForwardBatch into one model forward, sampled ids and logprobs.

Owns the model, the paged KV cache, the slot table (each slot's page table, grown by
the deltas the scheduler sends, its rope mode and its retention state), the sampler
and, on CUDA with FlashInfer, the decode CUDA graphs (cuda_graph.py); runner_setup.py
builds them. The per-step work here is tensor building from the batch (O(batch) Python),
the forward (replayed from a graph for decode batches up to the largest captured size),
and sampling.
"""

from __future__ import annotations

import logging
import math
import time

import torch

from radixrt.config import ServerArgs
from radixrt.config_views import TierConfig
from radixrt.kernels import (
    AttentionBackend,
    AttentionMetadata,
    PagedKVCache,
    default_attention_backend,
)
from radixrt.messages import (
    BatchEntry,
    BatchResult,
    EntryError,
    EntryLogprobs,
    ForwardBatch,
    KVMove,
    LoadLora,
    LoraLoaded,
    SpecVerdict,
    SpotCheck,
    SpotCheckResult,
    WeightsLoaded,
    WorkerReady,
)
from radixrt.models import reload_weights
from radixrt.models.cpu_matmul import pack_linear_weights
from radixrt.utils.checkpoint_meta import incompatibility
from radixrt.worker.cuda_graph import DecodeGraphRunner
from radixrt.worker.draft_model import DraftModel
from radixrt.worker.draft_trees import branch_copies, depth_shifts, kept_paths, refuse_trees, tree_masks
from radixrt.worker.kv_calibration import KVCalibrationError, PrecisionReport
from radixrt.worker.kv_tiers import prepare_disk_dir
from radixrt.worker.logprobs import LogitRows, entry_logprobs
from radixrt.worker.memory_figures import MemoryFigures
from radixrt.worker.ranks import Ranks
from radixrt.worker.readouts import read_outs
from radixrt.worker.retention_tensors import gather_mass, refusals
from radixrt.worker.runner_setup import (
    attention_over,
    build_kv_pool,
    capture_decode_graphs,
    check_quantized_kv,
    init_tensor_parallel,
    kv_fingerprint,
    load_for_serving,
    lora_bank,
    model_shape,
    place,
    spot_checker,
    tier_store,
)
from radixrt.worker.sampler import Sampler, mask_disallowed
from radixrt.worker.slot_table import SlotTable
from radixrt.worker.tier_probe import TransferProbe, attention_per_position, probe_transfers
from radixrt.worker.verify import verify_drafts

logger = logging.getLogger(__name__)


def _try(fn, what: str) -> str | None:
    """Run fn; None, or why it failed (logged with its traceback)."""
    try:
        fn()
    except KVCalibrationError as e:
        return str(e)
    except Exception as e:
        logger.exception("%s failed", what)
        return f"{what} failed: {type(e).__name__}: {e}"
    return None


class ModelRunner:
    def __init__(self, args: ServerArgs, rank: int = 0, dist_init: str = "") -> None:
        self.args, self.page_size = args, args.page_size
        self.device = device = place(args, rank)
        self.tp = init_tensor_parallel(args, rank, dist_init, device)
        self.ranks = Ranks(self.tp, device)
        torch.manual_seed(args.random_seed)  # unseeded sampling draws from this
        self.model_path = args.model_path  # the checkpoint now loaded (a weight update changes it)
        self.cfg, self.dtype, self.context_length = model_shape(args, device)
        self.model, self.matmul, self.packing, self.quant = load_for_serving(args, self.cfg, self.dtype, device, self.ranks)
        self.lora = lora_bank(args, self.model, self.quant.scheme)  # before the pool: its slots take memory
        self.cache, self.bytes_per_token = build_kv_pool(args, self.cfg, self.dtype, device, self.ranks,
                                                         self.context_length)
        self.backend_name = args.attention_backend or default_attention_backend(device.type)
        self.attn = self._attention_over(self.cache)
        self.retention_refusals = refusals(self.model, self.attn, args.kv_retention)
        self.slots = SlotTable(args.max_running_requests, self.context_length, self.cache, self.model, device)
        if args.speculative.trees:
            refuse_trees(self.backend_name, self.cfg.attention_layers())
        self.draft = (DraftModel(args, self.cfg, self.cache, self.backend_name, device, self.ranks)
                      if args.speculative.algorithm == "STANDALONE" else None)
        self.kv_check: PrecisionReport | None = None  # the quantized pool's start-up check
        if self.cache.quantized:  # before graph capture: fp8's scales are folded in there
            self._check_quantized_kv()
        self.fingerprint = kv_fingerprint(args, self.dtype, self.cache, self.model_path)  # covers fp8's scales
        self.tiers = tier_store(args, rank, self.cache, self.bytes_per_token, self.fingerprint, device)
        self.transfers = probe_transfers(self.tiers) if self.tiers is not None else TransferProbe()
        self.graphs = self._capture_decode_graphs()
        self.sampler = Sampler(args.max_running_requests, self.cfg.vocab_size, device)
        self.spot = spot_checker(args, self.model, self.cache, self.dtype, device, self.context_length,
                                 self._attention_over)
        self.memory = MemoryFigures(device)
        logger.info("worker ready: %s on %s, %d pages of %d tokens", self.cfg.model_type, device, self.cache.num_pages,
                    args.page_size)

    def _attention_over(self, pool: PagedKVCache) -> AttentionBackend:
        """An attention backend of the serving one's kind over a pool (the serving one, the quantized
        pool's start-up check, the spot checks' reference)."""
        return attention_over(self.backend_name, pool, self.cfg, self.tp)

    def _check_quantized_kv(self) -> None:
        """Fit fp8 scales to the weights held; KVCalibrationError when quantized KV is too far off."""
        self.kv_check = check_quantized_kv(self.args, self.model, self.attn, self._attention_over)

    def _capture_decode_graphs(self) -> DecodeGraphRunner | None:
        return capture_decode_graphs(self.args, self.model, self.attn, self.device, self.slots.page_table.shape[1])

    def spot_check(self, msg: SpotCheck) -> SpotCheckResult:
        """One chunk of a quality spot check (every rank runs it; rank 0's answer counts)."""
        if self.spot is None:
            return SpotCheckResult(msg.check_id, True, error="this worker has no spot-check pool")
        result = self.spot.run(msg)
        result.memory = self.memory.due()
        return result

    def move(self, moves: list[KVMove]) -> None:
        """Run the scheduler's tier moves (before the forward that needs them). The ranks agree on
        which disk file operations failed: a page lost on any rank is lost on all."""
        assert self.tiers is not None, "KV tier moves without a host tier"
        self.tiers.run(moves)
        if self.tiers.disk is not None:  # every rank ran the same moves: as many outcomes, in the same order
            self.tiers.disk.settle(self.ranks.reduce_each(self.tiers.disk.outcomes(), torch.distributed.ReduceOp.MAX))

    def load_lora(self, msg: LoadLora) -> LoraLoaded:
        """Every rank reads the adapter into its slot; any rank's failure is the answer (the slot
        then holds nothing the scheduler will use)."""
        assert self.lora is not None, "LoadLora without --enable-lora"
        why = _try(lambda: self.lora.load(msg.slot, msg.adapter), f"loading LoRA adapter {msg.adapter.name!r}")
        failed = self.ranks.first_failed(why is not None)
        if failed is not None:
            return LoraLoaded(msg.slot, why or f"rank {failed} could not load LoRA adapter {msg.adapter.name!r}")
        return LoraLoaded(msg.slot)

    # -- weight updates ----------------------------------------------------------------------

    def load_weights(self, model_path: str) -> WeightsLoaded:
        """Swap in the weights at model_path on every rank or on none. The scheduler sends this
        only with the pool drained and flushes the old KV after it. A quantized pool's check
        runs again (fp8 scales refit to the new weights); whatever fails on any rank rolls every
        rank back to the weights it had, and the reply says why."""
        why = incompatibility(self.model_path, model_path)  # the headers first: nothing is read on a misfit
        if self.quant.scheme != "none":
            why = (f"the weights are served quantized ({self.quant.scheme}); radixrt does not update quantized "
                   "weights in place: restart the server on the new checkpoint")
        if (failed := self.ranks.first_failed(why is not None)) is not None:
            return WeightsLoaded(False, why or f"rank {failed} refused {model_path}; see its log")
        why = _try(lambda: self._reload(model_path), f"loading {model_path}")
        failed = self.ranks.first_failed(why is not None)
        if failed is None and self.cache.quantized:
            why = _try(self._check_quantized_kv, "the quantized KV check")
            failed = self.ranks.first_failed(why is not None)
        if failed is not None:
            self._reload(self.model_path)  # NOTE: a failure here ends the worker
            if self.cache.quantized:
                self._check_quantized_kv()
            why = why or f"rank {failed} could not load {model_path}; see its log"
            return WeightsLoaded(False, f"{why}; the weights of {self.model_path} keep serving")
        self.model_path = model_path
        self.fingerprint = kv_fingerprint(self.args, self.dtype, self.cache, model_path)
        if self.graphs is not None and self.cache.layer_scaled:  # capture folded fp8's old scales in
            self.graphs = self._capture_decode_graphs()
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
            disk.dir, disk.capacity = prepare_disk_dir(TierConfig.of(self.args), self.fingerprint, page_bytes)
            why = None
        except ValueError as e:
            why = str(e)
        if self.ranks.first_failed(why is not None) is not None:
            disk.turn_off(why or "another rank cannot use the new weights' directory")
            return "", 0
        return str(disk.dir), disk.capacity

    def _reload(self, model_path: str) -> None:
        """The weights at model_path in place of the ones held, their packed copies with them."""
        reload_weights(self.model, model_path, self.device)
        if self.packing.packed:
            pack_linear_weights(self.model)

    def ready_message(self) -> WorkerReady:
        kernels, kernels_reason = self.attn.kernels_info()
        return WorkerReady(
            num_pages=self.cache.num_pages,
            page_size=self.page_size,
            vocab_size=self.cfg.vocab_size,
            context_length=self.context_length,
            eos_ids=list(self.cfg.eos_ids),
            bytes_per_token=self.bytes_per_token,
            page_bytes=self.bytes_per_token * self.page_size,
            **(self.tiers.describe() if self.tiers is not None else {}),
            h2d_s_per_page=self.transfers.h2d_s_per_page,
            disk2d_s_per_page=self.transfers.disk2d_s_per_page,
            attention_per_position=attention_per_position(self.cfg),
            long_prompt_threshold=self.model.rope.long_from or 0,
            kv_pool_bytes=sum(b.nbytes for b in self.cache.buffers),
            page_table_bytes=self.slots.page_table.nbytes,
            weight_bytes=sum(p.nbytes for p in self.model.parameters()),
            lora_pool_bytes=self.lora.nbytes() if self.lora is not None else 0,
            weights_fingerprint=self.fingerprint,
            retention_refusals=self.retention_refusals,
            memory=self.memory.read(),
            matmul_dtype=str(self.matmul.dtype).removeprefix("torch."),
            matmul_dtype_reason=self.matmul.reason,
            weight_packing="onednn" if self.packing.packed else "none",
            weight_packing_reason=self.packing.reason,
            weight_quantization=self.quant.scheme,
            weight_quantization_reason=self.quant.reason,
            attention_kernels=kernels,
            attention_kernels_reason=kernels_reason,
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> BatchResult:
        """Run the batch. What one request's parameters break (its sampling state, its
        sample, its logprobs) fails that entry alone, reported in BatchResult.errors; an
        exception out of here (the model forward, the KV pool) is the worker's end.

        Every rank runs every entry's forward and page-table update, failed or not, so
        the ranks' KV stays in lockstep; failures only change what rank 0 answers."""
        start = time.perf_counter()
        failed = self._apply_slot_changes(batch)  # entry index -> why; grown by sampling and logprobs
        entries = batch.entries
        if self.draft is not None:  # STANDALONE: the draft model keeps up, and drafts where asked
            self.draft.copy_pages(batch)
            entries = self.draft.propose(entries, self._prepare)
        meta, input_ids, positions = self._prepare(entries)
        if self.graphs is not None and not meta.mass_reqs and self.graphs.can_run(meta):
            hidden = self.graphs.replay(meta, input_ids, positions)  # [T, hidden]
        else:
            self.attn.init_forward(meta)
            if self.lora is not None:
                self.lora.plan(self.slots.lora_rows(entries), self.device)
            hidden = self.model(input_ids, positions, self.attn)  # [T, hidden]
            if self.lora is not None:
                self.lora.clear_plan()  # spot checks and drafts run the base model
        rows = LogitRows.plan(entries)
        logits = self.model.compute_logits(hidden[rows.index(self.device)])  # [R, vocab] float32
        page_mass = gather_mass(self.attn, entries, meta.mass_reqs, self.tp)  # every rank: an all-reduce
        disk = self.tiers.take_faults() if self.tiers is not None else None  # agreed: rank 0's stand for all
        ids: list[int | None] = []
        verdicts: dict[int, SpecVerdict] = {}
        if self.tp.rank == 0:  # the others took part in the forward and the logits gather; rank 0 samples
            ids, verdicts = self._sample(entries, rows, logits, failed)
        if meta.trees:  # every rank: the kept branches' KV where their sequences continue
            self._keep_branches(entries, verdicts)
        if self.tp.rank != 0:
            return BatchResult(step=batch.step, next_ids=[])
        logprobs: list[EntryLogprobs | None] = []
        if rows.any_logprobs:
            logprobs = entry_logprobs(entries, rows, logits, ids, failed)
        readouts = read_outs(entries, hidden, self.model, rows, logits, failed)
        moved = self.tiers.take_times() if self.tiers is not None else []
        errors = [EntryError(i, failed[i]) for i in sorted(failed)]
        next_ids = [t for t in ids if t is not None]  # an entry that failed its sample has none
        # sampled ids are on the host: the device has finished the step (else, on CUDA, it may not have)
        took = time.perf_counter() - start if next_ids or self.device.type != "cuda" else 0.0
        return BatchResult(step=batch.step, next_ids=next_ids, logprobs=logprobs, move_times=moved,
                           forward_seconds=took, errors=errors, page_mass=page_mass, memory=self.memory.due(), disk=disk,
                           spec=[verdicts[i] for i in sorted(verdicts)], readouts=readouts)

    def _sample(
        self, entries: list[BatchEntry], rows: LogitRows, logits: torch.Tensor, failed: dict[int, str]
    ) -> tuple[list[int | None], dict[int, SpecVerdict]]:
        """Per entry its next id (None: no sample, or it failed: added to `failed`), and the verdicts
        of the entries that verified drafts (worker/verify.py), by entry index."""
        ids: list[int | None] = [None] * len(entries)
        verifying = [i for i, e in enumerate(entries) if e.sample and e.draft_len and i not in failed]
        spec: dict[int, SpecVerdict] = {}
        for i, v in (verify_drafts(self.sampler, entries, rows, logits, verifying) if verifying else {}).items():
            if isinstance(v, str):
                failed[i] = v
            else:
                spec[i] = v[0]
                ids[i] = v[1]
        picks = [i for i, e in enumerate(entries) if e.sample and not e.draft_len and i not in failed]
        if not picks:
            return ids, spec
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
        return ids, spec

    def _keep_branches(self, entries: list[BatchEntry], verdicts: dict[int, SpecVerdict]) -> None:
        """Every rank: each draft tree's kept branch (rank 0's verdicts) moves its KV down to the
        cache indices right after its root."""
        paths = self.ranks.share(kept_paths(entries, verdicts) if self.tp.rank == 0 else
                                 [-1] * sum(e.draft_len for e in entries if e.draft_parents))
        slots, src, dst = branch_copies(entries, paths)
        if slots:
            self.cache.copy_slots(self.slots.cache_slots(slots, src), self.slots.cache_slots(slots, dst))

    def _apply_slot_changes(self, batch: ForwardBatch) -> dict[int, str]:
        """Freed slots, new slots' sampling state, copy-on-write copies and page-table deltas.
        Returns the entries whose sampling state was refused (entry index -> why)."""
        for slot in batch.freed_slots:
            self.sampler.remove(slot)
        self.slots.apply(batch)
        failed: dict[int, str] = {}
        for i, e in enumerate(batch.entries):
            why = self._start_slot(e) if e.init is not None else None
            if why is not None:
                failed[i] = why
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
        page_table = self.slots.rows(slots, max_pages)  # [B, max_pages]
        ps = self.page_size
        out_slots = page_table[req_of_row, positions // ps] * ps + positions % ps  # [T]
        trees = tree_masks(entries, dev)
        if trees:  # a draft's rope position is its root's plus its depth
            positions = positions - depth_shifts(entries, trees, dev)
        positions, grew = self.slots.positions(entries, positions, req_of_row)  # cache index -> rope table row
        if grew and self.graphs is not None:  # the rope tables moved: graphs captured the old ones
            self.graphs = self._capture_decode_graphs()
        mass_reqs = [i for i, e in enumerate(entries) if e.want_mass]
        return AttentionMetadata(qo_lens, kv_lens, page_table, out_slots, ps, mass_reqs, trees), input_ids, positions

"""DraftModel: STANDALONE speculative decoding's small model, in the worker beside the target.

Its KV lives in a pool of its own with as many pages as the target's, read through the
target's page tables: page p of the draft pool holds the draft's KV of the tokens whose
target KV is in page p. So a prefix the radix tree caches for the target is cached for the
draft too, and a copy-on-write copy is made in both pools. The scheduler keeps the exception
(pages a lower tier or a swap brought back hold target KV only: scheduler/speculation.py).

Each step the draft runs over the same tokens as the target (every entry's input, prefill
chunks included), so its KV keeps up; then, for the entries asking for drafts
(BatchEntry.propose), it decodes greedily: its argmax after the entry's last token is the
first draft, and each draft runs in turn to give the next, the last one too, so that the
draft's KV covers every token the target may accept. The target then verifies the entry's
input with the drafts appended (worker/verify.py).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import msgspec
import torch

from radixrt.config import ServerArgs
from radixrt.kernels import AttentionBackend, AttentionMetadata, PagedKVCache
from radixrt.messages import BatchEntry, ForwardBatch
from radixrt.models.config import ModelConfig
from radixrt.models.parallel import rank_heads
from radixrt.worker.ranks import Ranks
from radixrt.worker.runner_setup import attention_over, load_for_serving, model_shape

logger = logging.getLogger(__name__)

Prepare = Callable[[list[BatchEntry]], tuple[AttentionMetadata, torch.Tensor, torch.Tensor]]


class DraftModel:
    def __init__(self, args: ServerArgs, target: ModelConfig, target_pool: PagedKVCache, backend: str,
                 device: torch.device, ranks: Ranks) -> None:
        path = args.speculative.draft_model_path
        # the draft runs unquantized (speculative_draft_model_quantization is refused), whatever the target's weights
        draft_args = dataclasses.replace(args, model_path=path, tokenizer_path=None, context_length=None,
                                         quantization=None, torchao_config="", load_format="auto")
        self.cfg, dtype, context = model_shape(draft_args, device)
        if self.cfg.vocab_size != target.vocab_size:
            raise ValueError(f"the draft model {path} has a vocabulary of {self.cfg.vocab_size} tokens, the target "
                             f"{target.vocab_size}: STANDALONE needs a draft that shares the target's tokenizer")
        if context < (args.context_length or target.max_position_embeddings):
            raise ValueError(f"the draft model {path} holds {context} positions, fewer than the target's context")
        self.model, _, _, _ = load_for_serving(draft_args, self.cfg, dtype, device, ranks)
        _, _, _, kv_heads = rank_heads(self.cfg, ranks.tp)
        # one draft page per target page, under the same ids
        self.pool = PagedKVCache(self.cfg.num_layers, target_pool.num_pages, target_pool.page_size, kv_heads,
                                 self.cfg.head_dim, dtype, device)
        self.attn: AttentionBackend = attention_over(backend, self.pool, self.cfg, ranks.tp)
        self.device = device
        logger.info("draft model %s: %d layers, a pool of %d pages (%.1f MB)", path, self.cfg.num_layers,
                    self.pool.num_pages, sum(b.nbytes for b in self.pool.buffers) / 1e6)

    def copy_pages(self, batch: ForwardBatch) -> None:
        """The batch's copy-on-write copies, in the draft pool too."""
        if batch.copy_src:
            t = lambda x: torch.tensor(x, dtype=torch.int64, device=self.device)
            self.pool.copy_slots(t(batch.copy_src), t(batch.copy_dst))

    @torch.inference_mode()
    def propose(self, entries: list[BatchEntry], prepare: Prepare) -> list[BatchEntry]:
        """Run the draft over the entries' tokens; the entries, those with `propose` extended by
        that many drafts (draft_len set) for the target to verify."""
        meta, input_ids, positions = prepare(entries)
        hidden = self._run(meta, input_ids, positions)  # [T, hidden]
        askers = [i for i, e in enumerate(entries) if e.propose]
        if not askers:
            return entries
        ends = torch.tensor(meta.qo_lens, device=self.device).cumsum(0) - 1  # [B] each entry's last row
        drafts = {i: [t] for i, t in zip(askers, self._argmax(hidden[ends[askers]]))}
        ran = dict.fromkeys(askers, 0)  # drafts run through the draft model so far
        while steps := [i for i in askers if ran[i] < len(drafts[i])]:
            step = [self._next_entry(entries[i], drafts[i][ran[i]], ran[i]) for i in steps]
            meta, input_ids, positions = prepare(step)
            picks = self._argmax(self._run(meta, input_ids, positions))  # one row per entry
            for i, t in zip(steps, picks):
                ran[i] += 1
                if len(drafts[i]) < entries[i].propose:
                    drafts[i].append(t)
        return [msgspec.structs.replace(e, input_ids=e.input_ids + drafts[i], draft_len=len(drafts[i]))
                if i in drafts else e for i, e in enumerate(entries)]

    def _run(self, meta: AttentionMetadata, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.attn.init_forward(meta)
        return self.model(input_ids, positions, self.attn)

    def _argmax(self, hidden: torch.Tensor) -> list[int]:
        """hidden: [R, hidden] -> the draft's greedy token per row (the same on every rank)."""
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()

    @staticmethod
    def _next_entry(e: BatchEntry, token: int, ran: int) -> BatchEntry:
        """One draft token of e's request, run after its input and the drafts before it."""
        return BatchEntry(slot=e.slot, input_ids=[token], start_pos=e.start_pos + len(e.input_ids) + ran, new_pages=[],
                          sample=True, pos_offset=e.pos_offset)

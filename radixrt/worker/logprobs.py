"""Which hidden rows need logits in a step, and the logprobs read from them.

Logprobs are the log-softmax of the raw model logits (before temperature and
penalties), as vLLM and SGLang report them by default.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from radixrt.messages import BatchEntry, EntryLogprobs, LogprobSpec, TopLogprobs

logger = logging.getLogger(__name__)


@dataclass
class LogitRows:
    rows: list[int] = field(default_factory=list)  # token rows of the step's hidden states
    sample_pos: list[int] = field(default_factory=list)  # positions in `rows` to sample from, entry order
    # per entry: its position in `rows` (a verifying entry's draft_len + 1 rows start there)
    entry_sample: list[int | None] = field(default_factory=list)
    entry_prompt: list[int | None] = field(default_factory=list)  # per entry: first prompt-logprob position
    entry_labels: list[int | None] = field(default_factory=list)  # per entry: its "labels" readout's position
    any_logprobs: bool = False

    @classmethod
    def plan(cls, entries: list[BatchEntry]) -> LogitRows:
        plan, offset = cls(), 0
        for e in entries:
            lp = e.logprobs
            plan.any_logprobs |= lp is not None
            first = None
            if lp is not None and lp.prompt_from >= 0 and lp.prompt_targets:
                first = len(plan.rows)
                plan.rows.extend(range(offset + lp.prompt_from, offset + lp.prompt_from + len(lp.prompt_targets)))
            plan.entry_prompt.append(first)
            sample = None
            if e.sample:  # the last row, and before it one per draft to verify
                sample = len(plan.rows)
                plan.sample_pos.append(sample)
                plan.rows.extend(range(offset + len(e.input_ids) - 1 - e.draft_len, offset + len(e.input_ids)))
            plan.entry_sample.append(sample)
            labels = None
            if e.readout is not None and e.readout.kind == "labels":  # the next token after its last row
                labels = len(plan.rows)
                plan.rows.append(offset + len(e.input_ids) - 1)
            plan.entry_labels.append(labels)
            offset += len(e.input_ids)
        return plan

    def index(self, device: torch.device) -> torch.Tensor:
        return torch.tensor(self.rows, dtype=torch.int64, device=device)


def _top(logp: torch.Tensor, k: int) -> list[TopLogprobs]:
    """logp: [N, vocab] -> per row the k best (logprob, id)."""
    if k <= 0:
        return []
    vals, ids = logp.topk(k, dim=-1)
    return [list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist())]


def entry_logprobs(
    entries: list[BatchEntry], plan: LogitRows, logits: torch.Tensor, next_ids: list[int | None], failed: dict[int, str]
) -> list[EntryLogprobs | None]:
    """Per entry its logprobs (None: not asked, or failed). next_ids: per entry its sampled id
    (None when it did not sample). An entry already in `failed` is skipped; one whose own
    request makes it raise (say top_k above the vocabulary) is added to `failed`, alone."""
    logp = torch.log_softmax(logits, dim=-1)  # [R, vocab]
    out: list[EntryLogprobs | None] = []
    for i, (e, first, pos, next_id) in enumerate(zip(entries, plan.entry_prompt, plan.entry_sample, next_ids)):
        res = None
        if e.logprobs is not None and i not in failed:
            try:  # NOTE: per entry, not per token; free when nothing raises
                res = _entry(e.logprobs, logp, first, pos, next_id)
            except Exception as ex:
                logger.exception("logprobs failed for entry %d (slot %d)", i, e.slot)
                failed[i] = f"logprobs failed: {type(ex).__name__}: {ex}"
        out.append(res)
    return out


def _entry(
    lp: LogprobSpec, logp: torch.Tensor, first: int | None, pos: int | None, next_id: int | None
) -> EntryLogprobs:
    """One entry's logprobs from the step's logp [R, vocab]."""
    res = EntryLogprobs()
    if first is not None:
        block = logp[first : first + len(lp.prompt_targets)]
        targets = torch.tensor(lp.prompt_targets, dtype=torch.int64, device=logp.device)
        res.prompt = block.gather(1, targets[:, None]).squeeze(1).tolist()
        res.prompt_top = _top(block, lp.top_k)
    if lp.output and pos is not None and next_id is not None:
        res.output = logp[pos, next_id].item()
        res.output_top = _top(logp[pos : pos + 1], lp.top_k)[0] if lp.top_k > 0 else None
    return res

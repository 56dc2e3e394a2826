"""Quality spot checks, worker side: a finished request re-scored on the reference configuration.

The reference is what the live server would compute with nothing that trades quality for
memory or speed: KV in the model's dtype (not --kv-cache-dtype), every token kept (no retention
policy) and nothing from the prefix cache. The worker holds a scratch pool of its own for it,
one context long, allocated at start when --quality-spot-check-rate is set. A check is a
teacher-forced prefill of prompt + emitted tokens (but the last) in chunks, one chunk per
SpotCheck message, so the scheduler can stop between chunks when a live request arrives. At
every emitted token it takes the reference's logprob of that token and its top token, and
compares them with the logprob the live server gave the token (kv_calibration.compare_at).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import torch

from radixrt.kernels import AttentionBackend, AttentionMetadata
from radixrt.messages import SpotCheck, SpotCheckResult
from radixrt.worker.kv_calibration import compare_at

logger = logging.getLogger(__name__)


@dataclass
class _Check:
    check_id: int
    seq: list[int]  # prompt + emitted tokens but the last: row i predicts token i + 1
    first_row: int  # the row that predicts the first emitted token (prompt length - 1)
    targets: list[int]  # the emitted tokens
    live: list[float]  # the live server's logprob of each
    done_rows: int = 0  # rows run so far
    ref_logprob: list[torch.Tensor] = field(default_factory=list)  # per chunk [k] float32
    ref_top: list[torch.Tensor] = field(default_factory=list)  # per chunk [k] int64


class SpotChecker:
    def __init__(self, model: torch.nn.Module, attn: AttentionBackend, chunk: int) -> None:
        """attn: an attention backend over the scratch pool (model dtype, pages for one context)."""
        self.model, self.attn, self.chunk = model, attn, chunk
        self.page_size = attn.cache.page_size
        self.max_tokens = attn.cache.num_pages * self.page_size
        self.check: _Check | None = None

    @torch.inference_mode()
    def run(self, msg: SpotCheck) -> SpotCheckResult:
        """One chunk of check msg.check_id (a message with tokens starts it)."""
        if msg.output_ids:
            started = self._start(msg)
            if isinstance(started, str):
                return SpotCheckResult(msg.check_id, True, error=started)
            self.check = started
        c = self.check
        if c is None or c.check_id != msg.check_id:
            return SpotCheckResult(msg.check_id, True, error=f"spot check {msg.check_id} was never started here")
        self._run_chunk(c)
        if c.done_rows < len(c.seq):
            return SpotCheckResult(c.check_id, False)
        self.check = None
        dev = c.ref_top[0].device
        report = compare_at(torch.cat(c.ref_logprob), torch.cat(c.ref_top),
                            torch.tensor(c.live, dtype=torch.float32, device=dev),
                            torch.tensor(c.targets, dtype=torch.int64, device=dev))
        return SpotCheckResult(c.check_id, True, report.positions, report.top1_agreement, report.mean_abs_dlogprob,
                               report.max_abs_dlogprob)

    def _start(self, msg: SpotCheck) -> _Check | str:
        """The check, or why it cannot run."""
        self.check = None  # a new check replaces one the scheduler gave up on
        seq = list(msg.prompt_ids) + list(msg.output_ids[:-1])
        if len(msg.live_logprobs) != len(msg.output_ids) or not msg.prompt_ids or len(seq) > self.max_tokens:
            return (f"spot check {msg.check_id} refused: {len(msg.prompt_ids)} prompt tokens, {len(msg.output_ids)} "
                    f"emitted, {len(msg.live_logprobs)} logprobs, a scratch pool of {self.max_tokens} tokens")
        return _Check(msg.check_id, seq, len(msg.prompt_ids) - 1, list(msg.output_ids), list(msg.live_logprobs))

    def _run_chunk(self, c: _Check) -> None:
        """Rows [done_rows, done_rows + chunk) over the scratch pool's first pages."""
        dev = self.attn.cache.k[0].device
        start = c.done_rows
        ids = c.seq[start : start + self.chunk]
        n, ps = len(ids), self.page_size
        pages = math.ceil((start + n) / ps)
        table = torch.arange(pages, dtype=torch.int64, device=dev)[None, :]  # [1, pages]: scratch page i is page i
        positions = torch.arange(start, start + n, dtype=torch.int64, device=dev)  # [n]
        self.attn.init_forward(AttentionMetadata([n], [start + n], table, table[0, positions // ps] * ps + positions % ps, ps))
        hidden = self.model(torch.tensor(ids, dtype=torch.int64, device=dev), positions, self.attn)  # [n, hidden]
        lo = max(c.first_row - start, 0)  # rows before the first emitted token predict prompt tokens: skipped
        if lo < n:
            logp = torch.log_softmax(self.model.compute_logits(hidden[lo:]).float(), -1)  # [k, vocab]
            first = start + lo - c.first_row
            targets = torch.tensor(c.targets[first : first + n - lo], dtype=torch.int64, device=dev)  # [k]
            c.ref_logprob.append(logp.gather(-1, targets[:, None]).squeeze(-1))
            c.ref_top.append(logp.argmax(-1))
        c.done_rows = start + n

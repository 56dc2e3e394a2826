"""Logprob assembly for the scheduler: what each batch entry asks the worker for, and how
the worker's answers join a request's output.

Prompt logprobs arrive chunk by chunk as the prompt is prefilled and go out once, with
the output of the step that finishes the prompt; output logprobs go out with each token.
"""

from __future__ import annotations

from radixrt.messages import EntryLogprobs, LogprobSpec, ReqOutput
from radixrt.scheduler.req import Req


def logprob_spec(r: Req, start: int, n: int) -> LogprobSpec | None:
    """What r's entry running tokens [start, start + n) wants back (a spot-checked request: at
    least its emitted tokens' logprobs, which its client sees only if it asked)."""
    if not r.return_logprob:
        return LogprobSpec(-1, [], output=True) if r.spot_check else None
    prompt_from, targets = -1, []
    if r.wants_prompt_logprobs:
        # Row j predicts prompt token j + 1; wanted targets are [max(start_len, 1), prompt_len).
        lo = max(start, max(r.logprob_start_len, 1) - 1)
        hi = min(start + n, r.prompt_len - 1)
        if hi > lo:
            prompt_from, targets = lo - start, r.prompt_ids[lo + 1 : hi + 1]
    return LogprobSpec(prompt_from, targets, r.top_logprobs_num, output=True)


def collect_prompt_logprobs(r: Req, lp: EntryLogprobs | None) -> None:
    """Keep a prefill chunk's prompt logprobs until the prompt is done."""
    if lp is not None and lp.prompt:
        r.input_logprobs += lp.prompt
        r.input_top += lp.prompt_top


def attach_prompt_logprobs(r: Req, out: ReqOutput) -> None:
    """Once the whole prompt has run: its logprobs go out with this output (once)."""
    if r.kv_len < r.prompt_len or not r.wants_prompt_logprobs:
        return
    first: list = [None] if r.logprob_start_len == 0 else []  # the first token has no logprob
    out.input_logprobs = first + r.input_logprobs
    out.input_top = first + r.input_top if r.top_logprobs_num > 0 else None
    r.prompt_logprobs_sent = True


def attach_output_logprobs(lp: EntryLogprobs | None, out: ReqOutput) -> None:
    if lp is None or lp.output is None:
        return
    out.output_logprobs = [lp.output]
    out.output_top = [lp.output_top] if lp.output_top is not None else []


def forget_prompt_logprobs(r: Req) -> None:
    """r is retracted to recompute: its prompt logprobs, unless sent, are computed again."""
    if not r.prompt_logprobs_sent:
        r.input_logprobs, r.input_top = [], []

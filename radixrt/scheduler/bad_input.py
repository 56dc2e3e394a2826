"""What the scheduler refuses from the frontend, and why, in words that name the field.

The HTTP door validates every request, but the scheduler does not rely on it: a
message that does not decode, or a request the model cannot run (ids outside
the vocabulary, a prompt as long as the context), would otherwise kill the
scheduler or the worker. Such a request is answered with a finished abort,
status 400, and the loop goes on. Nothing here raises.
"""

from __future__ import annotations

from typing import Any

import msgspec

from radixrt.messages import MAX_PIN_TTL_S, FinishReason, ReqOutput, TokenizedRequest


def bad_request(why: str) -> FinishReason:
    return FinishReason("abort", message=why, status_code=400)


def internal_error(why: str) -> FinishReason:
    """A step failed for one request through no fault of the client's."""
    return FinishReason("abort", message=f"internal error: {why}", status_code=500)


def rejection(rid: str, why: str, prompt_tokens: int = 0) -> ReqOutput:
    return ReqOutput(rid, [], bad_request(why), prompt_tokens)


def rid_of(raw: bytes) -> str | None:
    """The string "rid" of a payload that is at least a msgpack map, else None."""
    try:
        obj: Any = msgspec.msgpack.decode(raw)
    except Exception:  # not msgpack at all (or too deep): there is nobody to answer
        return None
    rid = obj.get("rid") if isinstance(obj, dict) else None
    return rid if isinstance(rid, str) else None


def request_problem(msg: TokenizedRequest, vocab_size: int, context_length: int | None) -> str | None:
    """Why the model cannot run msg (None: it can). Checks what would otherwise fail the
    model forward for the whole batch; what fails one entry (say top_logprobs_num above
    the vocabulary) the worker isolates. context_length None: the request is not bounded
    by the context (a bounded-KV retention policy keeps its KV within a page table)."""
    ids = msg.input_ids
    if not ids:
        return "input_ids: the prompt is empty"
    if not (0 <= min(ids) and max(ids) < vocab_size):
        bad = next(i for i in ids if not 0 <= i < vocab_size)
        return f"input_ids: {bad} is outside the vocabulary of {vocab_size}"
    if context_length is not None and len(ids) >= context_length:
        return f"input_ids: the prompt has {len(ids)} tokens; the context length is {context_length}"
    if not -1 <= msg.logprob_start_len < len(ids):
        return f"logprob_start_len: must be in [-1, {len(ids)}), got {msg.logprob_start_len}"
    if msg.top_logprobs_num < 0:
        return f"top_logprobs_num: must be >= 0, got {msg.top_logprobs_num}"
    if msg.pin_ttl is not None and not 0 < msg.pin_ttl <= MAX_PIN_TTL_S:
        return f"cache_control: a pin lasts more than 0 and at most {MAX_PIN_TTL_S:g} seconds, got {msg.pin_ttl}"
    if msg.sampling.max_new_tokens is None:  # the frontend turns null into the room left in the context
        return "max_new_tokens: null must be resolved against the context before it reaches the scheduler"
    try:
        msg.sampling.check()
    except ValueError as e:
        return str(e)
    return None

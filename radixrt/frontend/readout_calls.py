"""Prefill-only calls: embeddings, label-token scores and reranking, as GenerateInputs whose items
read their answer out of the forward (messages.Readout, max_new_tokens 0) and so take /generate's
whole path: the door's checks, the radix cache, the scheduler's batches. Here too: the inputs'
shapes checked (SGLang 0.5.9's), and the answers decoded from the readouts' float32 values.
Torch-free (numpy)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from radixrt.errors import RequestError
from radixrt.frontend.generate_input import GenerateInput, GenerateItem, split_prompts
from radixrt.frontend.req_state import ReqState, cached_tokens_details
from radixrt.messages import Readout
from radixrt.sampling_params import SamplingParams
from radixrt.settings.pooling import Pooler

Prompt = tuple[str | None, list[int] | None]  # (text, token ids): exactly one is given
ENCODING_FORMATS = ("float", "base64")
# A call's prompts sharing at least this many leading tokens have them prefilled once, first
# (Intake.prepare's share_prefix): a score's query, a reranker's template and query
SHARED_PREFIX_MIN_TOKENS = 16


def readout_input(prompts: list[Prompt], readout: Readout, *, is_batch: bool, rid: Any = None,
                  priority: int | None = None, log_metrics: bool = True) -> GenerateInput:
    """One item per prompt, reading `readout` out instead of generating. rid: one per prompt (a
    list) or one for a single prompt, as /generate takes them."""
    rids = rid if isinstance(rid, list) else [rid] * len(prompts)
    if isinstance(rid, list) and len(rid) != len(prompts):
        raise RequestError(f"rid has {len(rid)} entries for {len(prompts)} inputs", "rid")
    if not isinstance(rid, list) and rid is not None and len(prompts) > 1:
        raise RequestError("a batch takes a list of rids, one per input", "rid")
    sampling = SamplingParams(max_new_tokens=0)
    items = [GenerateItem(prompt=text, input_ids=ids, sampling=sampling, rid=r, return_logprob=False,
                          logprob_start_len=None, top_logprobs_num=0, return_text_in_logprobs=False,
                          log_metrics=log_metrics, priority=priority, readout=readout)
             for (text, ids), r in zip(prompts, rids)]
    return GenerateInput(items, is_batch)


def shared_prefix_len(ids: list[list[int]], at_least: int) -> int:
    """The leading tokens every one of several prompts has (0 for one prompt, or fewer than at_least)."""
    if len(ids) < 2:
        return 0
    first, n = ids[0], min(len(i) for i in ids)
    for other in ids[1:]:
        n = next((k for k in range(n) if other[k] != first[k]), n)
    return n if n >= at_least else 0


def encode_prompts(text: Any, input_ids: Any) -> tuple[list[Prompt], bool]:
    """/encode's text or input_ids (one or a list; SGLang's rule: exactly one of them)."""
    texts, ids, is_batch = split_prompts(text, input_ids)
    if texts is not None:
        if any(not isinstance(t, str) for t in texts):
            raise RequestError("text pairs ([query, document]) are a cross-encoder's: set is_cross_encoder_request",
                               "text")
        return [(t, None) for t in texts], is_batch
    return [(None, list(i)) for i in ids], is_batch


def embedding_prompts(value: Any) -> tuple[list[Prompt], bool]:
    """OpenAI's `input`: a string, a list of strings, a list of token ids, or a list of such lists."""
    if isinstance(value, str):
        return [(value, None)], False
    if not value:
        raise RequestError("input is empty", "input")
    kinds = {str if isinstance(v, str) else list if isinstance(v, list) else int for v in value}
    if len(kinds) != 1:
        raise RequestError("input must be a string, a list of strings, a list of token ids or a list of such lists, "
                           "not a mix", "input")
    kind = kinds.pop()
    if kind is int:
        return [(None, list(value))], False
    return [(v, None) if kind is str else (None, list(v)) for v in value], True


def embedding(state: ReqState, pooler: Pooler, dimensions: int | None) -> np.ndarray:
    """The request's pooled vector, cut to `dimensions` and then normalized where the model's
    pooling normalizes (SGLang's order)."""
    vec = readout_values(state)
    if dimensions is not None:
        vec = vec[:dimensions]
    if pooler.normalize:
        vec = vec / max(float(np.linalg.norm(vec)), 1e-12)  # torch's F.normalize eps
    return vec.astype(np.float32)


def encode_results(states: list[ReqState], pooler: Pooler, dimensions: int | None) -> list[dict[str, Any]]:
    """/encode's (and Engine.encode's) answer per request: its embedding and its meta_info."""
    return [{"embedding": embedding(s, pooler, dimensions).tolist(), "meta_info": readout_meta(s)} for s in states]


def readout_meta(s: ReqState) -> dict[str, Any]:
    """SGLang's embedding meta_info, with the prefix cache's hit (cached_tokens, by tier)."""
    return {"id": s.rid, "finish_reason": s.finish.to_dict() if s.finish else None, "prompt_tokens": len(s.prompt_ids),
            "cached_tokens": s.cached_tokens, "cached_tokens_details": cached_tokens_details(s.cached_details),
            "weight_version": s.weight_version, "e2e_latency": (s.finished_at or s.created) - s.created}


def encode_vector(vec: np.ndarray, encoding_format: str) -> list[float] | str:
    """OpenAI's two formats: a float list, or base64 of little-endian float32 (as the openai client decodes it)."""
    if encoding_format == "base64":
        return base64.b64encode(vec.astype("<f4").tobytes()).decode("ascii")
    return vec.tolist()


def check_encoding_format(value: str) -> None:
    if value not in ENCODING_FORMATS:
        raise RequestError(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, got {value!r}",
                           "encoding_format")


def score_prompts(query: Any, items: Any, item_first: bool) -> list[Prompt]:
    """SGLang's score_request: each item after the query (before it with item_first), as text when
    both are text and as token ids when both are ids."""
    if items is None or (isinstance(items, list) and not items):
        raise RequestError("items must be given: a string, a list of strings or a list of token id lists", "items")
    if isinstance(query, str) and (isinstance(items, str) or all(isinstance(i, str) for i in items)):
        listed = [items] if isinstance(items, str) else items
        return [(f"{i}{query}" if item_first else f"{query}{i}", None) for i in listed]
    if isinstance(query, list) and isinstance(items, list) and all(isinstance(i, list) for i in items):
        return [(None, i + query if item_first else query + i) for i in items]
    raise RequestError("query and items must both be text or both be token ids (items: a list of id lists)", "items")


def label_scores(state: ReqState, apply_softmax: bool) -> list[float]:
    """The label tokens' probabilities after the prompt; with apply_softmax, renormalized over the
    labels alone (SGLang's: a softmax over their logprobs)."""
    logp = readout_values(state).astype(np.float64)
    if apply_softmax:
        e = np.exp(logp - logp.max())
        return (e / e.sum()).tolist()
    return np.exp(logp).tolist()


def readout_values(state: ReqState) -> np.ndarray:
    """A finished request's readout, as float32 values."""
    if state.readout is None:
        raise RuntimeError(f"request {state.rid} finished without its readout")
    return np.frombuffer(state.readout, dtype=np.float32)

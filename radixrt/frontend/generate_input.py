"""GenerateInput: one /generate call (Engine or HTTP) normalized into per-request items.

Accepts SGLang's shapes: `text` or `input_ids`, one or a list; sampling_params
one dict for all or a list with one per prompt; per-item or shared logprob
options; `n` parallel samples expanded into n requests. Everything is
validated before anything is sent, so a bad item fails the whole call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from radixrt.sampling_params import SamplingParams


@dataclass(frozen=True)
class GenerateItem:
    prompt: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    rid: str | None
    return_logprob: bool
    logprob_start_len: int | None
    top_logprobs_num: int
    return_text_in_logprobs: bool
    cache_salt: str | None


@dataclass(frozen=True)
class GenerateInput:
    items: list[GenerateItem]  # after n-expansion, in output order
    is_batch: bool  # the caller gave a list: answer with a list

    @classmethod
    def build(
        cls,
        text: Any = None,
        input_ids: Any = None,
        sampling_params: Any = None,
        rid: Any = None,
        return_logprob: Any = False,
        logprob_start_len: Any = None,
        top_logprobs_num: Any = None,
        return_text_in_logprobs: bool = False,
        cache_salt: Any = None,
    ) -> GenerateInput:
        if (text is None) == (input_ids is None):
            raise ValueError("give exactly one of text (prompt) or input_ids")
        is_batch = isinstance(text, list) if text is not None else bool(input_ids) and isinstance(input_ids[0], list)
        prompts = (text if is_batch else [text]) if text is not None else None
        ids = (input_ids if is_batch else [input_ids]) if input_ids is not None else None
        n = len(prompts if prompts is not None else ids)
        if is_batch and n == 0:
            raise ValueError("the prompt list is empty")
        params = [SamplingParams.from_dict(p) for p in _per_item(sampling_params, n, "sampling_params")]
        rids = _per_item(rid, n, "rid")
        lps = _per_item(return_logprob, n, "return_logprob")
        starts = _per_item(logprob_start_len, n, "logprob_start_len")
        tops = _per_item(top_logprobs_num, n, "top_logprobs_num")
        salts = _per_item(cache_salt, n, "cache_salt")
        items = []
        for i in range(n):
            for k in range(params[i].n):
                items.append(GenerateItem(
                    prompts[i] if prompts is not None else None, ids[i] if ids is not None else None,
                    _nth_sample(params[i], k), _nth_rid(rids[i], params[i].n, k), bool(lps[i]),
                    starts[i], tops[i] or 0, return_text_in_logprobs, salts[i],
                ))
        return cls(items, is_batch)


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    """One value per prompt: a list must have n items; a scalar (or dict) applies to all."""
    if isinstance(value, list):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} items for {n} prompts")
        return value
    return [value] * n


def _nth_sample(sp: SamplingParams, k: int) -> SamplingParams:
    """The k-th of n parallel samples: n=1 each, distinct seeds when seeded."""
    if sp.n == 1:
        return sp
    return msgspec.structs.replace(sp, n=1, seed=None if sp.seed is None else sp.seed + k)


def _nth_rid(rid: str | None, n: int, k: int) -> str | None:
    return rid if rid is None or n == 1 else f"{rid}-{k}"

"""GenerateInput: one /generate call (Engine or HTTP) normalized into per-request items.

`GenerateRequest` is the native request, typed field by field (SGLang's
names and shapes): the HTTP door decodes the body straight into it, and the
Engine converts its keyword arguments into it, so both doors accept and refuse
the same things. Accepts `text` or `input_ids`, one or a list; sampling_params
one object for all or a list with one per prompt; per-item or shared logprob
options; `n` parallel samples expanded into n requests (at most max_n).
Everything is validated before anything is sent, so a bad item fails the
whole call and nothing of it runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Union

import msgspec

from radixrt.errors import RequestError, from_validation
from radixrt.sampling_params import Int64, NonNegInt, SamplingParams, SamplingParamsIn

DEFAULT_MAX_N = 128
TokenIds = list[NonNegInt]
Salt = Annotated[str, msgspec.Meta(max_length=4096)]


class GenerateRequest(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    """The body of POST /generate (and Engine.generate's arguments)."""

    text: Union[str, list[str], None] = None
    input_ids: list[Union[NonNegInt, TokenIds]] | None = None  # one prompt's ids, or a list of them
    sampling_params: Union[SamplingParamsIn, list[SamplingParamsIn], None] = None
    rid: Union[str, list[str], None] = None
    return_logprob: Union[bool, list[bool], None] = None
    logprob_start_len: Union[Int64, list[Int64], None] = None
    top_logprobs_num: Union[NonNegInt, list[NonNegInt], None] = None
    return_text_in_logprobs: bool = False
    stream: bool = False
    log_metrics: bool = True
    cache_salt: Union[Salt, list[Salt], None] = None
    extra_key: Union[Salt, list[Salt], None] = None  # SGLang's other name for the cache namespace
    # SGLang fields this server cannot honour: any value but null (or false) is a 400 naming the field.
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    lora_path: Any = None
    session_params: Any = None
    custom_logit_processor: Any = None
    return_hidden_states: Any = None
    token_ids_logprob: Any = None


UNSUPPORTED_FIELDS = ("image_data", "video_data", "audio_data", "input_embeds", "lora_path", "session_params",
                      "custom_logit_processor", "return_hidden_states", "token_ids_logprob")


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
    max_tokens_given: bool = True  # the client set max_new_tokens (checked against the context, as SGLang does)


@dataclass(frozen=True)
class GenerateInput:
    items: list[GenerateItem]  # after n-expansion, in output order
    is_batch: bool  # the caller gave a list: answer with a list

    @classmethod
    def build(cls, max_n: int = DEFAULT_MAX_N, **fields: Any) -> GenerateInput:
        """From Python values (Engine.generate's arguments); None means "not given"."""
        try:
            req = msgspec.convert({k: v for k, v in fields.items() if v is not None}, GenerateRequest)
        except msgspec.ValidationError as e:
            raise from_validation(e) from None
        return cls.from_request(req, max_n)

    @classmethod
    def from_request(cls, req: GenerateRequest, max_n: int = DEFAULT_MAX_N) -> GenerateInput:
        for name in UNSUPPORTED_FIELDS:
            if getattr(req, name) not in (None, False):
                raise RequestError(f"{name} is not supported by this server", name)
        prompts, ids, is_batch = _prompts(req.text, req.input_ids)
        n = len(prompts if prompts is not None else ids)
        raw_params = _per_item(req.sampling_params, n, "sampling_params")
        converted: dict[int, SamplingParams] = {}  # a shared sampling_params object is validated once
        for p in raw_params:
            if id(p) not in converted:
                converted[id(p)] = SamplingParams.from_dict(p)
        params = [converted[id(p)] for p in raw_params]
        for p in params:
            if p.n > max_n:
                raise RequestError(f"sampling_params.n is {p.n}; this server allows at most {max_n} (--max-n)", "n")
        rids = _per_item(req.rid, n, "rid")
        lps = _per_item(req.return_logprob, n, "return_logprob")
        starts = _per_item(req.logprob_start_len, n, "logprob_start_len")
        tops = _per_item(req.top_logprobs_num, n, "top_logprobs_num")
        salts = _per_item(req.cache_salt if req.cache_salt is not None else req.extra_key, n, "cache_salt")
        items = []
        for i in range(n):
            given = raw_params[i] is not None and (raw_params[i].max_new_tokens is not None or raw_params[i].max_tokens is not None)
            for k in range(params[i].n):
                items.append(GenerateItem(
                    prompts[i] if prompts is not None else None, ids[i] if ids is not None else None,
                    _nth_sample(params[i], k), _nth_rid(rids[i], params[i].n, k), bool(lps[i]),
                    starts[i], tops[i] or 0, req.return_text_in_logprobs, salts[i], given,
                ))
        return cls(items, is_batch)


def _prompts(text: Any, input_ids: Any) -> tuple[list[str] | None, list[list[int]] | None, bool]:
    """(texts, id lists, is_batch): exactly one of text and input_ids, one prompt or a list."""
    if (text is None) == (input_ids is None):
        raise RequestError("give exactly one of text (prompt) or input_ids", "text")
    if text is not None:
        is_batch = isinstance(text, list)
        if is_batch and not text:
            raise RequestError("the prompt list is empty", "text")
        return (text if is_batch else [text]), None, is_batch
    is_batch = bool(input_ids) and isinstance(input_ids[0], list)
    if any(isinstance(x, list) != is_batch for x in input_ids):
        raise RequestError("input_ids must be a list of token ids or a list of such lists, not a mix", "input_ids")
    return None, (input_ids if is_batch else [input_ids]), is_batch


def _per_item(value: Any, n: int, name: str) -> list[Any]:
    """One value per prompt: a list must have n items; a scalar (or object) applies to all."""
    if isinstance(value, list):
        if len(value) != n:
            raise RequestError(f"{name} has {len(value)} items for {n} prompts", name)
        return value
    return [value] * n


def _nth_sample(sp: SamplingParams, k: int) -> SamplingParams:
    """The k-th of n parallel samples: n=1 each, distinct seeds when seeded."""
    if sp.n == 1:
        return sp
    return msgspec.structs.replace(sp, n=1, seed=None if sp.seed is None else (sp.seed + k) % (1 << 64))


def _nth_rid(rid: str | None, n: int, k: int) -> str | None:
    return rid if rid is None or n == 1 else f"{rid}-{k}"

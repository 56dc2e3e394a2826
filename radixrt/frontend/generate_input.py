"""GenerateInput: one /generate call (Engine or HTTP) normalized into per-request items.

`GenerateRequest` is the native request, typed field by field (SGLang's
names and shapes): the HTTP door decodes the body straight into it, and the
Engine converts its keyword arguments into it, so both doors accept and refuse
the same things. Accepts `text` or `input_ids`, one or a list; sampling_params
one object for all or a list with one per prompt; per-item or shared logprob
options; `n` parallel samples expanded into n requests (at most max_n).
Everything is validated before anything is sent, so a bad item fails the
whole call and nothing of it runs.

Every field of SGLang 0.5.9's GenerateReqInput is accepted (tests/test_sglang_fields.py
reads them from SGLang's source): those this server cannot honour are listed
in UNSUPPORTED_FIELDS with SGLang's default (any other value is a 400 naming
the field), those that change nothing in the answer in IGNORED_FIELDS.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, Union

import msgspec

from radixrt.errors import RequestError, from_validation
from radixrt.frontend.cache_control import CacheControl, pin_ttl
from radixrt.messages import Readout
from radixrt.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.sampling_params import Int64, NonNegInt, SamplingParams, SamplingParamsIn, refuse_unsupported

DEFAULT_MAX_N = 128
TokenIds = list[NonNegInt]
SALT_MAX_CHARS = 4096  # a cache_salt or extra_key at most
Salt = Annotated[str, msgspec.Meta(max_length=SALT_MAX_CHARS)]


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
    log_metrics: bool = True  # false: the request is left out of /metrics (health probes)
    # The prefix-cache namespace of cache_salt and extra_key (cache_namespace: either alone as SGLang
    # has it, the two together never colliding); cache_salt is radixrt's native spelling, extra_key SGLang's.
    cache_salt: Union[Salt, list[Salt], None] = None
    extra_key: Union[Salt, list[Salt], None] = None
    # radixrt's: keep the prompt cached for a time (frontend/cache_control.py), one for all prompts or one each
    cache_control: Union[CacheControl, list[Union[CacheControl, None]], None] = None
    # SGLang's OpenAI field, accepted here too: /generate writes meta_info.cached_tokens_details
    # whether asked or not, as SGLang 0.5.9's /generate does
    return_cached_tokens_details: bool = False
    # Not SGLang's field, but sglang-router adds it to what it forwards (and SGLang's /generate drops
    # unknown fields): accepted, and it selects nothing (one model per server).
    model: Any = None
    # SGLang's fields this server does not honour: see UNSUPPORTED_FIELDS and IGNORED_FIELDS.
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    token_ids_logprob: Any = None
    return_hidden_states: Any = False
    return_routed_experts: Any = False
    routed_experts_start_len: Any = 0
    modalities: Any = None
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    # SGLang's: with --reasoning-parser, a grammar holds only what follows the reasoning's end marker
    require_reasoning: bool = False
    data_parallel_rank: Any = None
    background: Any = False
    return_bytes: Any = False
    return_entropy: Any = False
    need_wait_for_image: Any = None
    num_items_assigned: Any = None
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None
    image_max_dynamic_patch: Any = None
    video_max_dynamic_patch: Any = None
    http_worker_ipc: Any = None
    conversation_id: Any = None
    priority: Any = None
    routing_key: Any = None
    no_logs: Any = False
    custom_labels: Any = None
    external_trace_header: Any = None
    validation_time: Any = None
    received_time: Any = None
    received_time_perf: Any = None


# SGLang 0.5.9 GenerateReqInput fields this server cannot honour, with SGLang's defaults:
# that value (or an empty one) is accepted, anything else is a 400 naming the field.
UNSUPPORTED_FIELDS: dict[str, Any] = {
    "input_embeds": None, "image_data": None, "video_data": None, "audio_data": None, "token_ids_logprob": None,
    "return_hidden_states": False, "return_routed_experts": False, "routed_experts_start_len": 0,
    "modalities": None, "session_params": None, "custom_logit_processor": None,
    "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None, "bootstrap_pair_key": None,
    "decode_tp_size": None, "data_parallel_rank": None, "background": False,
    "return_bytes": False, "return_entropy": False, "need_wait_for_image": None, "num_items_assigned": None,
    "max_dynamic_patch": None, "min_dynamic_patch": None, "image_max_dynamic_patch": None,
    "video_max_dynamic_patch": None, "http_worker_ipc": None,
}
# Fields whose value changes nothing in the answer (here, and in SGLang as launched by default):
# accepted with any value. Field -> why.
IGNORED_FIELDS: dict[str, str] = {
    "lora_id": "SGLang's TokenizerManager sets it from lora_path (the adapter's name) itself",
    "conversation_id": "tracking only",
    "routing_key": "no routing-key schedule policy (SGLang ignores it under any other policy)",
    "no_logs": "this server never logs request contents",
    "custom_labels": "no custom metric labels (SGLang ignores them unless allowed by a server flag)",
    "external_trace_header": "no request tracing (SGLang ignores it unless tracing is on)",
    "validation_time": "the server's own timestamps (SGLang overwrites them)",
    "received_time": "the server's own timestamps (SGLang overwrites them)",
    "received_time_perf": "the server's own timestamps (SGLang overwrites them)",
}


@dataclass(frozen=True, kw_only=True)
class GenerateItem:
    prompt: str | None
    input_ids: list[int] | None
    sampling: SamplingParams
    rid: str | None
    return_logprob: bool
    logprob_start_len: int | None
    top_logprobs_num: int
    return_text_in_logprobs: bool
    namespace: CacheNamespace = DEFAULT_NAMESPACE  # cache_namespace(cache_salt, extra_key)
    max_tokens_given: bool = True  # the client set max_new_tokens (checked against the context, as SGLang does)
    log_metrics: bool = True
    pin_ttl: float | None = None  # seconds its prompt stays cached (cache_control; None: no pin)
    priority: int | None = None  # SGLang's: its rank under --enable-priority-scheduling (None: the least)
    tenant: str | None = None  # the tenant its API key names (--api-keys-file; None: its cache_salt's)
    lora_name: str | None = None  # its LoRA adapter (SGLang's lora_path: the adapter's name); None: the base model
    require_reasoning: bool = False  # with --reasoning-parser: its grammar starts after the reasoning
    readout: Readout | None = None  # a prefill-only embedding or score (frontend/readout_calls.py); None: generates
    stream: bool = False  # its tokens go out as they come (the call's stream)


@dataclass(frozen=True)
class GenerateInput:
    items: list[GenerateItem]  # after n-expansion, in output order
    is_batch: bool  # the caller gave a list: answer with a list

    def for_tenant(self, tenant: str, share_cache: bool) -> GenerateInput:
        """The same call made by a tenant: its requests carry the tenant's name, and read and fill
        the tenant's own cache unless it shares the common one (each cache_salt still apart)."""
        items = [dataclasses.replace(it, tenant=tenant, namespace=it.namespace if share_cache else
                                     msgspec.structs.replace(it.namespace, tenant=tenant)) for it in self.items]
        return GenerateInput(items, self.is_batch)

    @classmethod
    def build(cls, max_n: int = DEFAULT_MAX_N, **fields: Any) -> GenerateInput:
        """From Python values (generate_request's), checked against max_n."""
        return cls.from_request(generate_request(**fields), max_n)

    @classmethod
    def from_request(cls, req: GenerateRequest, max_n: int = DEFAULT_MAX_N,
                     max_requests: int | None = None) -> GenerateInput:
        """max_requests: the most requests (prompts times n) the call may make (None: any; the
        Engine's offline batches); a larger call is refused before its prompts are looked at."""
        refuse_unsupported(req, UNSUPPORTED_FIELDS)
        prompts, ids, is_batch = split_prompts(req.text, req.input_ids)
        n = len(prompts if prompts is not None else ids)
        _check_call_size(n, [], max_requests, "text" if prompts is not None else "input_ids")
        raw_params = _per_item(req.sampling_params, n, "sampling_params")
        converted: dict[int, SamplingParams] = {}  # a shared sampling_params object is validated once
        for p in raw_params:
            if id(p) not in converted:
                converted[id(p)] = SamplingParams.from_dict(p)
        params = [converted[id(p)] for p in raw_params]
        for p in params:
            if p.n > max_n:
                raise RequestError(f"sampling_params.n is {p.n}; this server allows at most {max_n} (--max-n)", "n")
        _check_call_size(n, params, max_requests, "n")
        rids = _per_item(req.rid, n, "rid")
        lps = _per_item(req.return_logprob, n, "return_logprob")
        starts = _per_item(req.logprob_start_len, n, "logprob_start_len")
        tops = _per_item(req.top_logprobs_num, n, "top_logprobs_num")
        namespaces = [cache_namespace(a, b) for a, b in zip(_per_item(req.cache_salt, n, "cache_salt"),
                                                            _per_item(req.extra_key, n, "extra_key"))]
        pins = [pin_ttl(c) for c in _per_item(req.cache_control, n, "cache_control")]
        priorities = [_priority(p) for p in _per_item(req.priority, n, "priority")]
        loras = [_lora_name(x) for x in _per_item(req.lora_path, n, "lora_path")]
        items = []
        for i in range(n):
            for k in range(params[i].n):
                items.append(GenerateItem(
                    prompt=prompts[i] if prompts is not None else None, input_ids=ids[i] if ids is not None else None,
                    sampling=_nth_sample(params[i], k), rid=_nth_rid(rids[i], params[i].n, k),
                    return_logprob=bool(lps[i]), logprob_start_len=starts[i], top_logprobs_num=tops[i] or 0,
                    return_text_in_logprobs=req.return_text_in_logprobs, namespace=namespaces[i],
                    max_tokens_given=_max_tokens_given(raw_params[i]), log_metrics=req.log_metrics,
                    pin_ttl=pins[i], priority=priorities[i], lora_name=loras[i],
                    require_reasoning=req.require_reasoning, stream=req.stream,
                ))
        return cls(items, is_batch)


def generate_request(**fields: Any) -> GenerateRequest:
    """The request of Python values (Engine.generate's arguments); None means "not given"."""
    try:
        return msgspec.convert({k: v for k, v in fields.items() if v is not None}, GenerateRequest)
    except msgspec.ValidationError as e:
        raise from_validation(e) from None


def _check_call_size(prompts: int, params: list[SamplingParams], most: int | None, field: str) -> None:
    """Refuse a call of more than `most` requests (its prompts, times each one's n once params are known)."""
    total = sum(p.n for p in params) if params else prompts
    if most is not None and total > most:
        raise RequestError(f"this call makes {total} requests ({prompts} prompts, times n); this server allows at "
                           f"most {most} per call (--max-requests-per-call)", field)


def cache_namespace(cache_salt: str | None, extra_key: str | None) -> CacheNamespace:
    """The prefix-cache namespace of cache_salt and extra_key; the default one when both are empty.

    SGLang (serving_base._compute_extra_key) concatenates the non-empty ones, so salt "tenant"
    with extra_key "A" reads the cache of salt "tenant" + "A": a client whose salt a gateway sets
    could reach another tenant's namespace through extra_key. Here one of them alone keeps SGLang's
    value (itself, as the namespace's salt, whichever field it came in), and the two together fill
    both fields, which CacheNamespace keeps apart."""
    if cache_salt and extra_key:
        return CacheNamespace(salt=cache_salt, extra_key=extra_key)
    return CacheNamespace(salt=cache_salt or extra_key or None)


def _max_tokens_given(sp: SamplingParamsIn | None) -> bool:
    """Whether the client set max_new_tokens to a number (SGLang checks only those against the context)."""
    return sp is not None and any(isinstance(v, int) for v in (sp.max_new_tokens, sp.max_tokens))


def split_prompts(text: Any, input_ids: Any) -> tuple[list[str] | None, list[list[int]] | None, bool]:
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


def _lora_name(value: Any) -> str | None:
    """SGLang's lora_path: an adapter's name (registered by --lora-paths or /load_lora_adapter), or null."""
    if value is None or isinstance(value, str):
        return value or None
    raise RequestError(f"lora_path must be an adapter's name (a string) or null, got {type(value).__name__}",
                       "lora_path")


def _priority(value: Any) -> int | None:
    """SGLang's priority: an integer (any sign), or null for none."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"priority must be an integer or null, got {type(value).__name__}", "priority")
    if not -(1 << 62) <= value <= 1 << 62:
        raise RequestError(f"priority must be within +-2**62, got {value}", "priority")
    return value


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

"""The typed request bodies of the HTTP API, and the one function that decodes them.

Every body is decoded straight from bytes into one of these msgspec Structs
(strict: a bool is not an int, a rid is a string, unknown fields are refused);
the structs' JSON Schemas are what /openapi.json publishes. The native
/generate body is `GenerateRequest` (it lives beside GenerateInput, which the
Engine shares). OpenAI names are OpenAI's, plus SGLang's extra sampling fields.

Every field of SGLang 0.5.9's CompletionRequest and ChatCompletionRequest is
accepted (tests/test_sglang_fields.py reads them from SGLang's source): those
this server cannot honour are in the *_UNSUPPORTED tables with SGLang's
default (any other value is a 400 naming the field), those that change
nothing in the answer in the *_IGNORED tables.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Union

import msgspec

from radixrt.errors import RequestError, from_validation
from radixrt.frontend.cache_control import CacheControl
from radixrt.frontend.generate_input import GenerateRequest, Salt
from radixrt.sampling_params import Int64, NonNegInt
from radixrt.server.readout_schemas import READOUT_BODY_TYPES


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool | None = False  # a last chunk with the usage of the whole request
    continuous_usage_stats: bool | None = False  # usage (so far) in every chunk


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    """response_format.json_schema: the JSON Schema the output must match (OpenAI's shape)."""

    name: str
    # Optional in the type only so that a missing schema gets openai_api's 400 naming response_format.
    schema: Annotated[dict[str, Any] | None, msgspec.Meta(description="The JSON Schema (required).")] = None
    description: str | None = None
    # Accepted for OpenAI clients; the output is held to the schema either way.
    strict: bool | None = None


RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True):
    """text: unconstrained; json_object: any JSON object; json_schema: output matching json_schema.schema."""

    # A plain str checked in openai_api (a 400 naming response_format and the type); the enum is for the docs.
    type: Annotated[str, msgspec.Meta(extra_json_schema={"enum": list(RESPONSE_FORMAT_TYPES)})]
    json_schema: JsonSchemaFormat | None = None


class OpenAISampling(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields /v1/completions and /v1/chat/completions share (OpenAI's, then SGLang's extras)."""

    model: str | None = None
    max_tokens: NonNegInt | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Annotated[int, msgspec.Meta(ge=1, le=1 << 31)] = 1
    stop: Union[str, list[str], None] = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    rid: Union[str, list[str], None] = None
    # The prefix-cache namespace of the two (generate_input.cache_namespace: never ambiguous)
    cache_salt: Salt | None = None
    extra_key: Salt | None = None
    # radixrt's: keep the prompt cached for a time (frontend/cache_control.py)
    cache_control: CacheControl | None = None
    # SGLang's extra sampling fields
    top_k: Int64 | None = None
    min_p: float | None = None
    min_tokens: NonNegInt | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[NonNegInt] | None = None
    ignore_eos: bool | None = None
    no_stop_trim: bool | None = None
    skip_special_tokens: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    # SGLang's: the answer's sglext.cached_tokens_details (not in streams, as in SGLang)
    return_cached_tokens_details: bool = False
    # SGLang's: the LoRA adapter's name (or a list, one per prompt); `model: "base:adapter"` wins over it
    lora_path: str | list[str | None] | None = None
    # OpenAI's: token id (a decimal string) -> a bias added to its logit; SGLang's: stop where a regex matches
    logit_bias: dict[str, float] | None = None
    stop_regex: Union[str, list[str], None] = None
    # Fields this server does not honour: see the tables below.
    session_params: Any = None
    custom_params: Any = None
    custom_logit_processor: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    data_parallel_rank: Any = None
    return_hidden_states: Any = False
    return_routed_experts: Any = False
    priority: Any = None


class CompletionRequest(OpenAISampling, kw_only=True):
    prompt: Union[str, list[Union[str, NonNegInt, list[NonNegInt]]]]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool = False  # each choice's text starts with its prompt (with logprobs: the prompt's first)
    suffix: Any = None
    best_of: Any = None
    custom_labels: Any = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str  # system, developer, user, assistant, tool or function (any case)
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    reasoning_content: str | None = None  # an assistant's earlier reasoning, for templates that show it
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers


class ChatCompletionRequest(OpenAISampling, kw_only=True):
    messages: Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]
    max_completion_tokens: NonNegInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool = True  # false: at most one call
    # The last message is an assistant's: true continues it (its text ends the prompt); false turns
    # it into a user message (SGLang's rule for templates that must end on a user turn).
    continue_final_message: bool = False
    # Extra variables for the chat template (SGLang: spaces_between_special_tokens among them sets
    # that sampling field); reasoning_effort is passed to the template as well.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["low", "medium", "high"] | None = "medium"
    # With --reasoning-parser (else ignored, as in SGLang): the reasoning goes to reasoning_content, and
    # a stream sends it as it comes (false: in one piece once it ends)
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    max_dynamic_patch: Any = None
    min_dynamic_patch: Any = None


# SGLang 0.5.9's OpenAI fields this server cannot honour, with SGLang's defaults: that value (or an
# empty one) is accepted, anything else is a 400 naming the field.
OPENAI_UNSUPPORTED: dict[str, Any] = {
    "session_params": None, "custom_params": None,
    "custom_logit_processor": None, "bootstrap_host": None, "bootstrap_port": None, "bootstrap_room": None,
    "data_parallel_rank": None, "return_hidden_states": False, "return_routed_experts": False,
}
COMPLETION_UNSUPPORTED: dict[str, Any] = {**OPENAI_UNSUPPORTED, "suffix": None, "best_of": 1}
CHAT_UNSUPPORTED: dict[str, Any] = {**OPENAI_UNSUPPORTED, "max_dynamic_patch": None, "min_dynamic_patch": None}
# Fields whose value changes nothing in the answer (here, and in SGLang as launched by default):
# accepted with any value. Field -> why.
OPENAI_IGNORED: dict[str, str] = {
    "user": "an end-user id for the client's own tracking",
}
COMPLETION_IGNORED: dict[str, str] = {
    **OPENAI_IGNORED,
    "custom_labels": "no custom metric labels (SGLang ignores them unless allowed by a server flag)",
}
CHAT_IGNORED: dict[str, str] = {**OPENAI_IGNORED}


class AbortBody(msgspec.Struct, forbid_unknown_fields=True):
    rid: str = ""
    abort_all: bool = False


class UpdateWeightsBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang 0.5.9's UpdateWeightFromDiskReqInput, every field (frontend/weights.py checks the
    ones radixrt cannot honour)."""

    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    flush_cache: bool = True
    manifest: dict[str, Any] | None = None
    # BaseReq's: a control call has no request to name, and no multi-process HTTP worker here
    rid: str | list[str] | None = None
    http_worker_ipc: str | None = None


class LoadLoraAdapterBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang 0.5.9's LoadLoRAAdapterReqInput (lora_id is its TokenizerManager's own: ignored)."""

    lora_name: str
    lora_path: str
    pinned: bool = False
    lora_id: str | None = None
    rid: str | list[str] | None = None
    http_worker_ipc: str | None = None


class UnloadLoraAdapterBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang 0.5.9's UnloadLoRAAdapterReqInput."""

    lora_name: str
    lora_id: str | None = None
    rid: str | list[str] | None = None
    http_worker_ipc: str | None = None


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang 0.5.9's TokenizeRequest (/tokenize, /v1/tokenize): one text or a list of texts."""

    model: str | None = None  # not checked, as in SGLang
    prompt: Union[str, list[str]]
    add_special_tokens: bool = True  # the model's special tokens (a BOS), as a prompt gets them


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang 0.5.9's DetokenizeRequest (/detokenize, /v1/detokenize): one id list or a list of them."""

    model: str | None = None  # not checked, as in SGLang
    tokens: list[Union[Int64, list[Int64]]]  # ids outside the vocabulary are a 400 naming tokens
    skip_special_tokens: bool = True


class SeparateReasoningBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang 0.5.9's SeparateReasoningReqInput (/separate_reasoning): a text and the parser's name."""

    text: str
    reasoning_parser: str  # radixrt/reasoning.py's names; another is a 400 naming it
    rid: str | list[str] | None = None  # BaseReq's: not used
    http_worker_ipc: str | None = None


# UpdateWeightsBody fields the call takes itself; the rest are options (frontend/weights.check_update_options)
UPDATE_CALL_FIELDS = ("model_path", "abort_all_requests", "weight_version", "rid", "http_worker_ipc")
BODY_TYPES: tuple[type, ...] = (GenerateRequest, CompletionRequest, ChatCompletionRequest, AbortBody, UpdateWeightsBody,
                                LoadLoraAdapterBody, UnloadLoraAdapterBody, TokenizeBody, DetokenizeBody, SeparateReasoningBody,
                                *READOUT_BODY_TYPES)


def decode_body(raw: bytes, kind: type) -> Any:
    """The body as `kind`, or RequestError naming the field (malformed JSON, wrong types,
    unknown fields, lone surrogates, nesting too deep to decode)."""
    try:
        return msgspec.json.decode(raw or b"{}", type=kind)
    except msgspec.ValidationError as e:
        raise from_validation(e) from None
    except msgspec.DecodeError as e:
        if re.search(rb"\\u[dD][89a-fA-F]", raw):  # msgspec reports a lone surrogate escape as truncated input
            raise RequestError("malformed JSON body: a \\u escape is a lone surrogate, which is not valid Unicode") from None
        raise from_validation(e) from None
    except RecursionError:
        raise RequestError("the JSON body is nested too deeply") from None


def openapi_schemas() -> tuple[dict[str, Any], dict[str, Any]]:
    """(schema per body type, shared components), with refs into #/components/schemas."""
    schemas, components = msgspec.json.schema_components(BODY_TYPES, ref_template="#/components/schemas/{name}")
    return dict(zip((t.__name__ for t in BODY_TYPES), schemas)), components

"""The typed request bodies of the HTTP API, and the one function that decodes them.

Every body is decoded straight from bytes into one of these msgspec Structs
(strict: a bool is not an int, a rid is a string, unknown fields are refused);
the structs' JSON Schemas are what /openapi.json publishes. The native
/generate body is `GenerateRequest` (it lives beside GenerateInput, which the
Engine shares). OpenAI names are OpenAI's, plus SGLang's extra sampling fields.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Union

import msgspec

from radixrt.errors import RequestError, from_validation
from radixrt.frontend.generate_input import GenerateRequest, Salt
from radixrt.sampling_params import Int64, NonNegInt


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


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
    logit_bias: dict[str, float] | None = None
    cache_salt: Salt | None = None
    response_format: ResponseFormat | None = None
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


class CompletionRequest(OpenAISampling, kw_only=True):
    prompt: Union[str, list[Union[str, NonNegInt, list[NonNegInt]]]]
    logprobs: Annotated[int, msgspec.Meta(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Annotated[int, msgspec.Meta(ge=1)] | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str  # system, user, assistant or tool
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
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


class AbortBody(msgspec.Struct, forbid_unknown_fields=True):
    rid: str = ""
    abort_all: bool = False


BODY_TYPES: tuple[type, ...] = (GenerateRequest, CompletionRequest, ChatCompletionRequest, AbortBody)


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

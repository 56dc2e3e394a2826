"""The typed bodies of the prefill-only routes, with SGLang 0.5.9's fields (tests/test_sglang_fields.py
reads them from its source): /encode's EmbeddingReqInput, OpenAI's /v1/embeddings, /v1/score's
ScoringRequest and /v1/rerank's V1RerankReqInput. Fields this server cannot honour are in
ENCODE_UNSUPPORTED with SGLang's default: any other value is a 400 naming the field."""

from __future__ import annotations

from typing import Any

import msgspec

from radixrt.frontend.generate_input import TokenIds
from radixrt.sampling_params import NonNegInt


class EncodeRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang 0.5.9's EmbeddingReqInput (/encode), with BaseReq's and APIServingTimingMixin's fields."""

    text: str | list[str | list[str]] | None = None  # [query, document] pairs: a cross-encoder's
    input_ids: list[NonNegInt | TokenIds] | None = None  # one prompt's ids, or a list of them
    rid: str | list[str] | None = None
    dimensions: int | None = None  # a Matryoshka model's: the vector cut to its first dimensions
    is_cross_encoder_request: bool = False  # text holds [query, document] pairs, scored by the model's head
    priority: int | None = None
    log_metrics: bool = True
    lora_path: Any = None  # SGLang's: the adapter (one per server here: refused but for None)
    lora_id: Any = None
    sampling_params: Any = None  # SGLang's: an embedding samples nothing, so ignored
    routing_key: str | None = None  # no routing-key policy here: ignored, as SGLang does under other policies
    external_trace_header: Any = None  # no tracing: ignored
    validation_time: Any = None  # the server's own timestamps
    received_time: Any = None
    received_time_perf: Any = None
    http_worker_ipc: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    input_embeds: Any = None
    modalities: Any = None
    background: bool = False


# EncodeRequest fields this server cannot honour, with SGLang's defaults (anything else: a 400 naming it)
ENCODE_UNSUPPORTED: dict[str, Any] = {
    "image_data": None, "video_data": None, "audio_data": None, "input_embeds": None, "modalities": None,
    "background": False, "lora_path": None, "lora_id": None,
}


class EmbeddingRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """OpenAI's /v1/embeddings body, with SGLang 0.5.9's extra fields."""

    input: str | list[str | NonNegInt | TokenIds]  # one mix of these: frontend/readout_calls.py
    model: str | None = None  # not checked, as in SGLang
    encoding_format: str = "float"  # "float" or "base64" (little-endian float32, as OpenAI's)
    dimensions: int | None = None
    user: str | None = None
    rid: str | list[str] | None = None
    priority: int | None = None
    lora_path: Any = None


class ScoringRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang 0.5.9's /v1/score: the probability of each label token after each query + item."""

    query: str | TokenIds | None = None  # text, or token ids (then items are token ids too)
    items: str | list[str | TokenIds] | None = None
    label_token_ids: list[NonNegInt] | None = None
    apply_softmax: bool = False  # softmax over the label tokens' logits, instead of their probabilities
    item_first: bool = False  # item + query instead of query + item
    model: str | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    """A rerank query's or document's part (SGLang's multimodal parts: only text is served here)."""

    type: str
    text: str | None = None
    image_url: Any = None
    video_url: Any = None


RerankContent = str | list[ContentPart]


class RerankRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """SGLang 0.5.9's V1RerankReqInput (/v1/rerank)."""

    query: RerankContent
    documents: list[RerankContent]
    instruct: str | None = None  # the reranker template's instruction
    top_n: int | None = None  # the best top_n only (default: all)
    return_documents: bool = True
    model: str | None = None  # OpenAI clients send it: not checked


READOUT_BODY_TYPES: tuple[type, ...] = (EncodeRequest, EmbeddingRequest, ScoringRequest, RerankRequest)

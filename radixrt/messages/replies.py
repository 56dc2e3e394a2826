"""What the scheduler sends the frontend: each step's outputs per request, and the control replies."""

from __future__ import annotations

from typing import Any, Union

import msgspec

from radixrt.stats import SchedulerStats


class FinishReason(msgspec.Struct, omit_defaults=True):
    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None
    # abort only: the HTTP status a failure maps to (400 the request, 500 our bug, 503 the backend);
    # None for an abort the client asked for
    status_code: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return msgspec.to_builtins(self)


TopLogprobs = list[tuple[float, int]]  # (logprob, token id), best first


class CachedTokensDetail(msgspec.Struct, array_like=True):
    """Where a request's cached prompt tokens came from (SGLang's cached_tokens_details): the
    device pool (the radix tree, a partially matching page included), pages loaded back from the
    host tier, and pages loaded from the disk tier. device + host + (storage or 0) == cached_tokens."""

    device: int
    host: int
    storage: int | None = None  # None: the server has no disk tier
    storage_backend: str = "file"  # what holds those: the disk tier's files, or a Mooncake Store


class SpecCounts(msgspec.Struct, array_like=True):
    """One request's speculative decoding so far (on a server that speculates)."""

    verify_ct: int = 0  # its decode steps: each verified its drafts, if it had any
    proposed: int = 0  # drafts verified
    accepted: int = 0  # drafts kept


class ReqOutput(msgspec.Struct, array_like=True):
    """What one request produced in one step."""

    rid: str
    new_ids: list[int]
    finish: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_logprobs: list[float] = []  # one per new id, when asked
    output_top: list[TopLogprobs] = []
    input_logprobs: list[float | None] | None = None  # sent once, when the prompt is done
    input_top: list[TopLogprobs | None] | None = None
    # seconds from its arrival at the scheduler to its first schedule (SGLang's queue_time); on
    # the first output after that, else None
    queue_time: float | None = None
    # cached_tokens by tier, with the hierarchical cache on and a hit; else None (as SGLang)
    cached_details: CachedTokensDetail | None = None
    spec: SpecCounts | None = None  # on a server that speculates: its figures so far
    readout: bytes | None = None  # with its finish, a Readout's result: float32 values, native byte order


class TokenBatchOut(msgspec.Struct, tag=True):
    outputs: list[ReqOutput]


class ControlReply(msgspec.Struct, tag=True):
    query_id: str
    stats: SchedulerStats
    error: str | None = None


class WeightsUpdateReply(msgspec.Struct, tag=True):
    query_id: str
    success: bool
    message: str
    weights_fingerprint: str = ""  # the new weights' (worker/kv_tiers.weights_fingerprint); "" when refused
    num_paused_requests: int = 0  # requests that arrived during the update and waited for it


class LoraUpdateReply(msgspec.Struct, tag=True):
    """SGLang's LoRAUpdateOutput: success, error_message and the adapters now loaded (name -> path)."""

    query_id: str
    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, str] = {}


SchedulerToFrontend = Union[TokenBatchOut, ControlReply, WeightsUpdateReply, LoraUpdateReply]

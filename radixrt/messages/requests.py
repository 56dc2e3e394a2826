"""What the frontend sends the scheduler: requests, aborts, and the control queries."""

from __future__ import annotations

from typing import Union

import msgspec

from radixrt.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.sampling_params import SamplingParams
from radixrt.settings.lora import AdapterConfig
from radixrt.settings.retention import Retention


class Readout(msgspec.Struct, array_like=True, frozen=True):
    """What a prefill-only request (max_new_tokens 0) reads out of its forward instead of a
    sample: an embedding or a score (radixrt/scheduler/readouts.py, radixrt/worker/readouts.py).

    kind "last" | "mean" | "cls": the final hidden state after the model's last norm, of the
    last token, averaged over every token, or of the first token; "labels": the logprobs of
    label_ids as the next token after the last one (SGLang's /v1/score); "head": the
    classification head's outputs at the last token (a ForSequenceClassification checkpoint)."""

    kind: str
    label_ids: list[int] = []

    @property
    def whole_prompt(self) -> bool:
        """It needs rows a cached prefix does not keep (the cache holds KV, not hidden states):
        every row's for "mean", the first's for "cls". The others read the last row only."""
        return self.kind in ("mean", "cls")


class TokenizedRequest(msgspec.Struct, tag=True):
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1  # first prompt position with a logprob; -1: none
    top_logprobs_num: int = 0
    namespace: CacheNamespace = DEFAULT_NAMESPACE  # its prefix cache: different namespaces never share pages
    # the bounded-KV settings it runs under, resolved at the door (radixrt/retention/rules.py); None: keeps all its KV
    retention: Retention | None = None
    # seconds its prompt's full pages stay cached (its cache_control, resolved at the door:
    # frontend/cache_control.py); None: no pin. At most MAX_PIN_TTL_S.
    pin_ttl: float | None = None
    priority: int | None = None  # SGLang's; the scheduler reads it under --enable-priority-scheduling
    tenant: str | None = None  # the tenant its API key names (None: its cache namespace's salt is its tenant)
    lora_name: str | None = None  # the LoRA adapter it runs (its lora_path); None: the base model
    # SGLang's: with --reasoning-parser, its grammar starts after the reasoning's end marker
    require_reasoning: bool = False
    readout: Readout | None = None  # a prefill-only request's embedding or score (max_new_tokens is 0)
    # its client reads tokens as they come: the decodes' cadence (--max-decode-slowdown) guards its pace
    stream: bool = False


MAX_PIN_TTL_S = 24 * 3600.0  # the longest pin a request may ask for


class AbortRequest(msgspec.Struct, tag=True):
    rid: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class Connected(msgspec.Struct, tag=True):
    """The scheduler's first message to each rank, sent before it says it is ready: the send
    returns only once the rank's channel is up, and a rank on another node sees node 0 go away
    only as the loss of a channel that was up (ipc.Receiver's watch_peer). The ranks ignore it."""


class GetStats(msgspec.Struct, tag=True):
    """Ask for the scheduler's counters; answered by a ControlReply."""

    query_id: str


class FlushCache(msgspec.Struct, tag=True):
    """Ask the scheduler to empty the prefix cache; answered by a ControlReply (error: why not)."""

    query_id: str


class UpdateWeights(msgspec.Struct, tag=True):
    """Swap in the weights at model_path (a local checkpoint directory, already checked to fit):
    requests received before it finish on the old weights (or are aborted first), later ones
    wait; then every rank loads, and the KV computed with the old weights is dropped. Answered
    by a WeightsUpdateReply."""

    query_id: str
    model_path: str
    abort_all_requests: bool = False


class LoadLoraAdapter(msgspec.Struct, tag=True):
    """Register an adapter the frontend has read and checked (its weights load into a slot when a
    request first needs them); answered by a LoraUpdateReply."""

    query_id: str
    adapter: AdapterConfig
    pinned: bool = False


class UnloadLoraAdapter(msgspec.Struct, tag=True):
    """Forget an adapter: new requests naming it are refused, its running ones finish, and its
    KV leaves every tier; answered by a LoraUpdateReply."""

    query_id: str
    lora_name: str


ControlQuery = Union[GetStats, FlushCache, UpdateWeights, LoadLoraAdapter, UnloadLoraAdapter]
FrontendMsg = Union[TokenizedRequest, AbortRequest, GetStats, FlushCache, UpdateWeights, LoadLoraAdapter,
                    UnloadLoraAdapter, Shutdown]

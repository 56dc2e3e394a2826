"""Req: one request's state in the scheduler, with its derived quantities named.

Its KV pages are in `kv`, a KVHandle that only KVMemory writes."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixrt.constrained.grammar import Matcher
from radixrt.constrained.reasoning_gate import ReasoningGate
from radixrt.messages import CachedTokensDetail, FinishReason, Readout, TokenizedRequest, TopLogprobs
from radixrt.namespace import DEFAULT_NAMESPACE, CacheNamespace, RopeMode
from radixrt.retention.policies import RetentionBudget
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.kv_handle import KVHandle
from radixrt.scheduler.stop_state import StopState
from radixrt.speculative.request_spec import RequestSpec


def longrope_namespace(namespace: CacheNamespace, long_rope: bool) -> CacheNamespace:
    """The prefix-cache namespace of a request to a longrope model. transformers computes a
    sequence under the short rope factors while it is at most the model's original context
    long and under the long ones past it, so the KV of the same tokens differs between the two
    and they never share pages: the rope mode is a field of the namespace (a short request
    without a salt stays in the default namespace)."""
    return namespace.with_rope(RopeMode.LONG if long_rope else RopeMode.SHORT)


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    namespace: CacheNamespace = DEFAULT_NAMESPACE  # its prefix cache (with the rope mode of a longrope model)
    long_rope: bool = False  # a longrope model's request past its original context: long rope factors
    retention: RetentionBudget | None = None  # its bounded-KV policy's pages (None: it keeps all its KV)
    pin_ttl: float | None = None  # seconds its prompt's full pages stay cached (None: no pin)
    output_ids: list[int] = field(default_factory=list)
    kv: KVHandle = field(default_factory=KVHandle)  # its pages (KVMemory writes, everyone else reads)
    grammar: Matcher | ReasoningGate | None = None  # a constrained request's position in its grammar
    require_reasoning: bool = False  # its grammar starts after the reasoning (with --reasoning-parser)
    stops: StopState | None = None  # its stop check's progress (scheduler/stop.py makes it at the first check)
    recompute_len: int = 0  # tokens of KV it had when retracted to recompute
    cached_tokens: int = -1  # prompt tokens reused from the prefix cache at first admission (-1: not yet)
    cached_details: CachedTokensDetail | None = None  # cached_tokens by tier (scheduler/cache_hits.py)
    slot: int | None = None  # worker slot while running
    slot_initialized: bool = False  # the worker has this request's sampling state
    admitted_at: int = 0  # admission counter, for retraction order
    finish: FinishReason | None = None
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[TopLogprobs] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    spot_check: bool = False  # a quality spot check re-scores it when done (scheduler/spot_checks.py)
    live_logprobs: list[float] = field(default_factory=list)  # spot_check: the logprob of each token it emitted
    spec: RequestSpec | None = None  # on a speculating server, from its first admission (scheduler/speculation.py)
    rank: int = 0  # its priority as an order, larger first (scheduler/priorities.py; 0 without priorities)
    tenant: str = ""  # whose share and quota it counts in (scheduler/tenants.py)
    arrived_at: float = 0.0  # time.monotonic() at intake: the waiting timeout's clock
    started_at: float | None = None  # time.monotonic() at its first admission: the running timeout's clock
    long_prefill: bool = False  # a long uncached prompt: the decodes' cadence cuts its chunks (step_budget.py)
    stream: bool = False  # its client reads tokens as they come: the decodes' cadence guards its pace
    lora_slot: int = -1  # while running: the worker slot of its LoRA adapter (scheduler/lora_slots.py); -1: none
    readout: Readout | None = None  # a prefill-only request's embedding or score (scheduler/readouts.py)
    readout_value: bytes = b""  # what the worker read out so far ("mean": the sum of the rows run)

    @classmethod
    def from_msg(cls, m: TokenizedRequest) -> Req:
        return cls(m.rid, m.input_ids, m.sampling, m.return_logprob, m.logprob_start_len, m.top_logprobs_num, m.namespace,
                   pin_ttl=m.pin_ttl, require_reasoning=m.require_reasoning, readout=m.readout, stream=m.stream)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def output_len(self) -> int:
        return len(self.output_ids)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def kv_len(self) -> int:
        """Tokens whose KV it has computed: those in its pages, and those retention dropped since."""
        return self.kv.kv_len + self.kv.dropped

    @property
    def extend_len(self) -> int:
        """Tokens still to run through the model before the next sample (1 while decoding)."""
        return self.seq_len - self.kv_len

    @property
    def is_decoding(self) -> bool:
        return self.extend_len == 1 and self.output_len > 0

    @property
    def remaining_tokens(self) -> int:
        return max(self.sampling.max_new_tokens - self.output_len, 0)

    @property
    def growth_tokens(self) -> int:
        """Tokens its pages may still grow by: the rest of its output, at most its retention budget."""
        if self.retention is None:
            return self.remaining_tokens
        return min(self.remaining_tokens, max(0, self.retention.max_tokens - self.kv.kv_len))

    @property
    def match_limit(self) -> int:
        """How much of the sequence may come from the cache: the last token must run (it
        yields the next-token logits), and so must every position whose prompt logprob is wanted."""
        limit = self.seq_len - 1
        if self.wants_prompt_logprobs:
            limit = min(limit, max(self.logprob_start_len, 1) - 1)
        if self.readout is not None and self.readout.whole_prompt:
            limit = 0
        if self.retention is not None:  # leave the first step a page to fill before any drop
            limit = min(limit, self.retention.max_tokens - self.retention.page_size)
        return limit

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.return_logprob and self.logprob_start_len >= 0 and not self.prompt_logprobs_sent

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        p = self.prompt_len
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

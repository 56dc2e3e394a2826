"""ReqState: what the frontend knows of one request, and its result in SGLang's layout.

meta_info.cached_tokens_details is SGLang 0.5.9's: always there, None without the hierarchical
cache or without a hit, else {"device", "host"} and, with a storage backend, "storage" and
"storage_backend" ("file": the disk tier; "mooncake": a Mooncake Store).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from radixrt.frontend.detokenizer import IncrementalDetokenizer
from radixrt.messages import CachedTokensDetail, FinishReason, ReqOutput, SpecCounts, TopLogprobs
from radixrt.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.sampling_params import SamplingParams

def cached_tokens_details(d: CachedTokensDetail | None) -> dict[str, Any] | None:
    """The detail in SGLang's shape: {"device", "host"}, plus "storage" and "storage_backend" with a disk tier."""
    if d is None:
        return None
    out: dict[str, Any] = {"device": d.device, "host": d.host}
    if d.storage is not None:
        out.update(storage=d.storage, storage_backend=d.storage_backend)
    return out


@dataclass
class ReqState:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    detok: IncrementalDetokenizer
    notify: Callable[[], None]  # called (from the receiving thread) after every update
    return_logprob: bool = False
    return_text_in_logprobs: bool = False
    log_metrics: bool = True  # false: the metrics observer never sees it (health probes)
    cache_namespace: CacheNamespace = DEFAULT_NAMESPACE  # the cache diagnosis keeps namespaces apart
    weight_version: str = "default"  # the weights that serve it (SGLang's label; a weight update may set it)
    output_ids: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    cached_tokens: int = 0
    cached_details: CachedTokensDetail | None = None  # cached_tokens by tier (None: no tiers, or no hit)
    spec: SpecCounts | None = None  # on a speculating server: its speculative decoding so far
    readout: bytes | None = None  # a prefill-only request's embedding or score, with its finish (float32)
    output_logprobs: list[float] = field(default_factory=list)
    output_top: list[TopLogprobs] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top: list[TopLogprobs | None] | None = None
    created: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        return self.finish is not None

    @property
    def error(self) -> FinishReason | None:
        """The finish reason when the request failed (an abort with an HTTP status), else None.
        An abort the client asked for is not an error: its partial result is the answer."""
        f = self.finish
        return f if f is not None and f.type == "abort" and f.status_code is not None else None

    def apply(self, out: ReqOutput) -> None:
        if out.new_ids:
            now = time.perf_counter()
            self.first_token_at = self.first_token_at or now
            self.last_token_at = now
        # NOTE: logprobs before ids: a reader on another thread that sees n output ids finds their logprobs.
        self.output_logprobs += out.output_logprobs
        self.output_top += out.output_top
        self.output_ids += out.new_ids
        self.cached_tokens = out.cached_tokens
        self.cached_details = out.cached_details
        self.spec = out.spec or self.spec
        if out.input_logprobs is not None:
            self.input_logprobs = out.input_logprobs
            self.input_top = out.input_top
        if out.readout is not None:
            self.readout = out.readout
        if out.finish is not None:
            self.finish = out.finish
            self.finished_at = time.perf_counter()
        self.notify()

    def fail(self, message: str, status_code: int = 503) -> None:
        """Finish with an abort that says why (the backend is gone: 503; our bug: 500)."""
        if self.finish is None:
            self.finish = FinishReason("abort", message=message, status_code=status_code)
            self.finished_at = time.perf_counter()
            self.notify()

    def result(self, tokenizer: Any, stream: bool = False) -> dict[str, Any]:
        text = self.detok.final_text(self.output_ids, self.finish) if self.done else self.detok.stream_text(self.output_ids)
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish.to_dict() if self.finish else None,
            "prompt_tokens": len(self.prompt_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.cached_tokens,
            "cached_tokens_details": cached_tokens_details(self.cached_details),
            "weight_version": self.weight_version,
            "e2e_latency": (self.finished_at or time.perf_counter()) - self.created,
        }
        if self.spec is not None:
            meta.update(spec_meta(self.spec, len(self.output_ids)))
        if self.return_logprob:
            meta.update(self._logprob_meta(tokenizer))
        return {"text": text, "output_ids": list(self.output_ids), "meta_info": meta}

    def _logprob_meta(self, tokenizer: Any) -> dict[str, Any]:
        def triple(lp: float | None, tid: int) -> list[Any]:
            text = tokenizer.decode([tid]) if self.return_text_in_logprobs else None
            return [lp, tid, text]

        def tops(rows: list[TopLogprobs | None] | None) -> list[Any]:
            return [None if row is None else [triple(lp, tid) for lp, tid in row] for row in rows or []]

        start = len(self.prompt_ids) - len(self.input_logprobs)
        return {
            "input_token_logprobs": [triple(lp, t) for lp, t in zip(self.input_logprobs, self.prompt_ids[start:])],
            "output_token_logprobs": [triple(lp, t) for lp, t in zip(self.output_logprobs, self.output_ids)],
            "input_top_logprobs": tops(self.input_top),
            "output_top_logprobs": tops(self.output_top),
        }


def spec_meta(spec: SpecCounts, completion_tokens: int) -> dict[str, Any]:
    """SGLang's speculative fields of meta_info: verify steps, tokens per verify step (the first
    token, from the prefill, included, as SGLang counts) and accepted / drafted tokens."""
    return {
        "spec_verify_ct": spec.verify_ct,
        "spec_accept_length": completion_tokens / spec.verify_ct if spec.verify_ct else 0.0,
        "spec_accept_rate": spec.accepted / spec.proposed if spec.proposed else 0.0,
        "spec_accept_token_num": spec.accepted,
        "spec_draft_token_num": spec.proposed,
    }

"""Intake: the frontend's door, in one pass. A call (a native GenerateRequest, or a GenerateInput
the Engine or a readout route built) comes out as the PreparedReqs to send; nothing is sent here.

Everything a request could be refused for at the door is found in that pass, as a RequestError
naming the field: the call's size (--max-n, --max-requests-per-call), a LoRA adapter that is
not loaded, and each item's prompt and options (frontend/prompt_checks.py: the context, the
vocabulary, Unicode, a grammar that does not compile, logprob options). `prepare_async` runs
the pass in a small thread pool, so an HTTP event loop never stalls on a long prompt; the
TokenizerManager registers and sends what comes out (all or nothing).
"""

from __future__ import annotations

import asyncio
import dataclasses
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from radixrt.config import ServerArgs
from radixrt.frontend.generate_input import GenerateInput, GenerateItem, GenerateRequest
from radixrt.frontend.lora_door import LoraDoor
from radixrt.frontend.prompt_checks import PromptChecks, logprob_start
from radixrt.frontend.readout_calls import SHARED_PREFIX_MIN_TOKENS, shared_prefix_len
from radixrt.frontend.sampling_defaults import model_sampling_defaults
from radixrt.messages import TokenizedRequest, WorkerReady
from radixrt.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.retention.rules import RetentionRules
from radixrt.sampling_params import SamplingParams
from radixrt.settings.pooling import load_pooler
from radixrt.settings.retention import Retention
from radixrt.settings.scheduling import TenantSpec
from radixrt.utils.stop_strings import StopStrings, StopStringsCache

TOKENIZE_THREADS = 4


@dataclass(frozen=True)
class PreparedReq:
    """One validated, tokenized request, ready to send."""

    ids: list[int]
    item: GenerateItem
    logprob_start: int
    stops: StopStrings | None = None  # the automaton of its stop strings, built off the event loop
    retention: Retention | None = None  # its bounded-KV settings, resolved (None: it keeps all its KV)

    def message(self, rid: str) -> TokenizedRequest:
        """What the scheduler gets for it, under rid."""
        it = self.item
        return TokenizedRequest(rid, self.ids, it.sampling, it.return_logprob, self.logprob_start,
                                it.top_logprobs_num, it.namespace, retention=self.retention, pin_ttl=it.pin_ttl,
                                priority=it.priority, tenant=it.tenant, lora_name=it.lora_name,
                                require_reasoning=it.require_reasoning, readout=it.readout, stream=it.stream)


@dataclass(frozen=True)
class PreparedCall:
    """A whole call, checked and tokenized: what TokenizerManager.submit sends."""

    reqs: list[PreparedReq]  # after n-expansion, in output order
    is_batch: bool  # the caller gave a list: answer with a list
    prefix: PreparedReq | None = None  # the prompts' shared prefix, prefilled alone first (share_prefix)


class Intake:
    def __init__(self, args: ServerArgs, tokenizer: Any, worker: WorkerReady, lora: LoraDoor) -> None:
        """worker: what the loaded model decided (context, vocabulary, EOS ids, retention refusals);
        lora: the adapters loaded, which a call may name."""
        self.args, self.tokenizer, self.lora = args, tokenizer, lora
        self.context_length, self.vocab_size = worker.context_length, worker.vocab_size
        # resolves each request's kv_retention against the server's settings, once, here
        self.retention = RetentionRules.for_worker(args.retention, worker)
        self.checks = PromptChecks(args, tokenizer, worker)
        self.text_bound = self.checks.text_bound  # prompt text that could fit (the chat door holds messages to it)
        # generation_config.json's sampling values for chat requests that leave them unset (--sampling-defaults)
        self.sampling_defaults = model_sampling_defaults(Path(args.model_path), args.sampling_defaults)
        self.pooler = load_pooler(args.model_path, args.pooler_config)  # how /encode and /v1/embeddings pool
        if self.pooler.head_labels and not args.is_embedding:
            raise ValueError("this checkpoint is a sequence classifier (…ForSequenceClassification): it has no "
                             "language-model head to generate with; launch it with --is-embedding")
        self._stop_strings = StopStringsCache()  # a call's n samples (and repeated lists) build theirs once
        self._pool = ThreadPoolExecutor(TOKENIZE_THREADS, thread_name_prefix="radixrt-tokenize")

    def prepare(self, call: GenerateRequest | GenerateInput, *, tenant: TenantSpec | None = None,
                max_requests: int | None = None, share_prefix: bool = False) -> PreparedCall:
        """The whole door for one call: its items (a request's checked against --max-n and
        max_requests; None: any number, the Engine's offline batches), under the caller's tenant,
        each checked, tokenized and prepared. share_prefix: when the prompts share a long prefix,
        it becomes a prefill-only request of its own, sent first so that all of them find it in
        the radix cache instead of each computing it in the same step. Raises RequestError."""
        gen = call if isinstance(call, GenerateInput) else GenerateInput.from_request(call, self.args.max_n,
                                                                                       max_requests)
        if tenant is not None:
            gen = gen.for_tenant(tenant.tenant, tenant.share_cache)
        self.lora.check(gen)
        memo: dict[int, list[int]] = {}  # the n samples of one prompt share its tokens
        reqs = []
        for item in gen.items:
            retention = self.retention.resolve(item.sampling.kv_retention)
            key = id(item.prompt if item.prompt is not None else item.input_ids)
            if key not in memo:
                memo[key] = self.checks.tokenize(item.prompt, item.input_ids, retention is not None)
            reqs.append(self._prepared(memo[key], self.checks.item(item, len(memo[key]), retention is not None),
                                       retention))
        return PreparedCall(reqs, gen.is_batch, self._shared_prefix(reqs) if share_prefix else None)

    async def prepare_async(self, call: GenerateRequest | GenerateInput, **options: Any) -> PreparedCall:
        """prepare (options: its keywords) in the thread pool, off the event loop."""
        return await self.run_off_loop(lambda: self.prepare(call, **options))

    async def run_off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run other heavy input work (decoding a body, a chat template) in the same pool."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def unchecked(self, ids: list[int], sampling: SamplingParams, *, rid: str | None = None,
                  return_logprob: bool = False, logprob_start_len: int | None = None, top_logprobs_num: int = 0,
                  return_text_in_logprobs: bool = False, namespace: CacheNamespace = DEFAULT_NAMESPACE) -> PreparedReq:
        """One already tokenized request as is: no door checks beyond the logprob options and its
        retention settings (tests that go past the door on purpose)."""
        item = GenerateItem(prompt=None, input_ids=ids, sampling=sampling, rid=rid, return_logprob=return_logprob,
                            logprob_start_len=logprob_start_len, top_logprobs_num=top_logprobs_num,
                            return_text_in_logprobs=return_text_in_logprobs, namespace=namespace)
        return self._prepared(list(ids), item, self.retention.resolve(sampling.kv_retention))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _prepared(self, ids: list[int], item: GenerateItem, retention: Retention | None) -> PreparedReq:
        start = logprob_start(len(ids), item.return_logprob, item.logprob_start_len, item.top_logprobs_num)
        stops = self._stop_strings.get(item.sampling.stop) if item.sampling.stop else None
        return PreparedReq(ids, item, start, stops, retention)

    def _shared_prefix(self, reqs: list[PreparedReq]) -> PreparedReq | None:
        """A prefill-only request of the call's shared prefix, when it is long enough to be worth one."""
        n = shared_prefix_len([p.ids for p in reqs], max(SHARED_PREFIX_MIN_TOKENS, self.args.page_size))
        if not n:
            return None
        first = reqs[0]
        item = dataclasses.replace(first.item, rid=None, readout=None, log_metrics=False)
        return PreparedReq(first.ids[:n], item, -1, retention=first.retention)

"""PromptChecks: one request's prompt tokenized and its options checked against the model, for
the door (frontend/intake.py), as RequestErrors naming the field.

A prompt that cannot fit the context is found from its length in characters before the
tokenizer runs (text_bound.py), then in tokens; ids outside the vocabulary, max_new_tokens
beside the prompt, stop ids and top_logprobs_num against the vocabulary, text that is not
valid Unicode, a grammar that does not compile and logprob options are refused. A request
under a bounded-KV retention policy has no context limit.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Iterable

import msgspec

from radixrt.config import ServerArgs
from radixrt.constrained.grammar import GrammarCompiler
from radixrt.errors import RequestError
from radixrt.frontend.generate_input import GenerateItem
from radixrt.frontend.text_bound import TextBound
from radixrt.messages import WorkerReady


class PromptChecks:
    def __init__(self, args: ServerArgs, tokenizer: Any, worker: WorkerReady) -> None:
        self.args, self.tokenizer = args, tokenizer
        self.context_length, self.vocab_size = worker.context_length, worker.vocab_size
        self._eos_ids = list(worker.eos_ids)
        self._grammars: GrammarCompiler | None = None  # made on the first constrained request
        self._grammar_lock = threading.Lock()  # the door runs in several threads
        max_token_bytes = max(len(t.encode("utf-8", "replace")) for t in tokenizer.get_vocab()) or 1
        self.text_bound = TextBound(worker.context_length, max_token_bytes)  # prompt text that could fit

    def tokenize(self, prompt: str | None, input_ids: list[int] | None, bounded: bool = False) -> list[int]:
        """Token ids of one prompt, checked against the vocabulary and the context
        (truncated to fit with --allow-auto-truncate). Raises RequestError. bounded: the request
        runs under a retention policy, which keeps its KV within a budget: no context applies."""
        if (prompt is None) == (input_ids is None):
            raise RequestError("give exactly one of prompt (text) or input_ids", "text")
        room = self.context_length - 1 if not bounded else 1 << 62  # room for at least one generated token
        if prompt is not None:
            if not isinstance(prompt, str):
                raise RequestError(f"prompt must be a string, got {type(prompt).__name__}", "text")
            # a text that cannot fit is refused (or cut) before the tokenizer spends seconds on it
            prompt = self.text_bound.fit(prompt, bounded, self.args.allow_auto_truncate, "text")
            _check_unicode(prompt, "text")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            check_in_vocabulary(input_ids, self.vocab_size, "input_ids")
            ids = list(input_ids)
        if not ids:
            raise RequestError("prompt is empty", "text" if prompt is not None else "input_ids")
        if len(ids) > room:
            if not self.args.allow_auto_truncate:
                raise RequestError(f"the prompt has {len(ids)} tokens; the context length is {self.context_length}",
                                   "text" if prompt is not None else "input_ids")
            del ids[room:]
        return ids

    def item(self, item: GenerateItem, prompt_len: int, bounded: bool) -> GenerateItem:
        """item, its max_new_tokens fitted to the context beside its prompt, once its options pass."""
        item = self._fit_to_context(item, prompt_len, bounded)
        self._check_options(item)
        return item

    def _fit_to_context(self, item: GenerateItem, prompt_len: int, bounded: bool) -> GenerateItem:
        """SGLang's rules: max_new_tokens null runs until a stop or the context limit; a number the
        client gave must fit beside the prompt in the context, else a 400 (with --allow-auto-truncate:
        cut to what fits). The default (128) is not checked: generation stops at the context anyway.
        bounded: the request runs under a retention policy, which no context limits."""
        sp, room = item.sampling, max(0, self.context_length - prompt_len)
        if sp.max_new_tokens is None:  # under a retention policy too: null keeps SGLang's meaning
            return _with_max_new_tokens(item, max(room, 1))
        if bounded or not item.max_tokens_given or prompt_len + sp.max_new_tokens < self.context_length:
            return item
        if not self.args.allow_auto_truncate:
            raise RequestError(
                f"the prompt ({prompt_len} tokens) plus max_new_tokens ({sp.max_new_tokens}) exceeds "
                f"the context length of {self.context_length} tokens (--allow-auto-truncate cuts it instead)",
                "max_new_tokens")
        return _with_max_new_tokens(item, room)

    def _check_options(self, item: GenerateItem) -> None:
        check_in_vocabulary(item.sampling.stop_token_ids, self.vocab_size, "stop_token_ids")
        check_in_vocabulary(item.sampling.logit_bias, self.vocab_size, "logit_bias")  # SGLang's check too
        if item.top_logprobs_num > self.vocab_size:
            raise RequestError(f"top_logprobs_num must be <= the vocabulary size {self.vocab_size}, "
                               f"got {item.top_logprobs_num}", "top_logprobs_num")
        for s in item.sampling.stop:
            _check_unicode(s, "stop")
        for s in item.sampling.stop_regex:
            _check_unicode(s, "stop_regex")
        if item.sampling.constraint is not None:
            self._grammar_compiler().compile(*item.sampling.constraint)  # a bad grammar is a 400 here
        ns = item.namespace
        for value, name in ((item.rid, "rid"), (ns.salt, "cache_salt"), (ns.extra_key, "extra_key")):
            if value is not None:
                _check_unicode(value, name)

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammar_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self._eos_ids,
                                                 max_whitespace=self.args.json_max_whitespace)
            return self._grammars


def check_in_vocabulary(ids: Iterable[int], vocab_size: int, field: str) -> None:
    """RequestError naming `field` for the first id outside [0, vocab_size), the model's vocabulary
    (its logits' width)."""
    bad = next((i for i in ids if not 0 <= i < vocab_size), None)
    if bad is not None:
        raise RequestError(f"{field} contains {bad}, outside the vocabulary of {vocab_size}", field)


def _with_max_new_tokens(item: GenerateItem, n: int) -> GenerateItem:
    sampling = msgspec.structs.replace(item.sampling, max_new_tokens=n, min_new_tokens=min(item.sampling.min_new_tokens, n))
    return dataclasses.replace(item, sampling=sampling)


def _check_unicode(text: str, field: str) -> None:
    """Lone surrogates cannot be tokenized nor sent: refuse them, naming the field."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{field} is not valid Unicode: {e.reason} at position {e.start}", field) from None


def logprob_start(prompt_len: int, return_logprob: bool, start: int | None, top_n: int) -> int:
    """Validate logprob options; without a start, one prompt logprob comes back (SGLang's default)."""
    if top_n < 0:
        raise RequestError(f"top_logprobs_num must be >= 0, got {top_n}", "top_logprobs_num")
    if not return_logprob:
        return -1
    if start is None or start == -1:
        return prompt_len - 1
    if not 0 <= start < prompt_len:
        raise RequestError(f"logprob_start_len must be in [0, {prompt_len}) for this prompt, got {start}",
                           "logprob_start_len")
    return start

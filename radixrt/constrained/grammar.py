"""Grammars for constrained decoding, on xgrammar: compiled by (kind, text) once, cached,
and a per-request matcher that says which tokens may come next.

The frontend compiles at the door to refuse a bad grammar with a 400 before anything
runs; the scheduler compiles (from its own cache, off its loop) the grammar its
matchers use. xgrammar is imported on first use: a server that never sees a
constraint never loads it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Iterable

import numpy

from radixrt.constrained.forced_text import Forced, ForcedBytes
from radixrt.errors import RequestError

KINDS = ("regex", "json_schema", "ebnf")  # the sampling_params fields that carry a grammar
CACHE_SIZE = 512  # compiled grammars kept, least recently used dropped first


class GrammarCompiler:
    """Compiles a (kind, text) grammar against one tokenizer and vocabulary; thread-safe.

    vocab_size is the model's (its logits' width): ids past the tokenizer's own (padding)
    are never allowed. stop_ids end a completed grammar (the model's eos ids). max_whitespace
    bounds the whitespace between a json_schema's JSON tokens (ServerArgs.json_max_whitespace):
    None any, 0 compact JSON (any_whitespace=False says the same), n at most n characters in a
    row. Regex and EBNF grammars are compiled as written. Each compiler has one setting, so its
    cache's (kind, text) keys stay exact."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int], any_whitespace: bool = True,
                 max_whitespace: int | None = None) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_ids))
        # NOTE: xgrammar lets padding ids through where the grammar allows any text (they decode
        # to nothing), so every mask is ANDed with the ids the tokenizer has.
        self._real_words = _words(range(min(len(tokenizer), vocab_size)), vocab_size)
        self._stop_words = _words(stop_ids, vocab_size)
        self._forced = ForcedBytes(info.decoded_vocab, vocab_size, stop_ids)
        self._xgr = xgr
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        self.max_whitespace = max_whitespace if any_whitespace else 0
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, kind: str, text: str) -> Any:
        """The compiled grammar; raises RequestError (naming the field, with xgrammar's reason, or
        saying that it accepts no string)."""
        key = (kind, text)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        compiled = self._compile(kind, text)
        if self.matcher(compiled).dead_end:
            raise RequestError(f"sampling_params.{kind} accepts no string: no token can start its output", kind)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, kind: str, text: str) -> Any:
        try:
            if kind == "regex":
                return self._compiler.compile_regex(text)
            if kind == "json_schema":
                return self._compile_json(text)
            if kind == "ebnf":
                return self._compiler.compile_grammar(text)
        except (RuntimeError, ValueError) as e:
            raise RequestError(f"sampling_params.{kind} is not a valid grammar: {_reason(e)}", kind) from None
        raise ValueError(f"unknown grammar kind {kind!r}")

    def _compile_json(self, text: str) -> Any:
        if self.max_whitespace == 0:  # xgrammar's compact form: no free whitespace, ", " and ": " between items
            return self._compiler.compile_json_schema(text, any_whitespace=False)
        return self._compiler.compile_json_schema(text, any_whitespace=True, max_whitespace_cnt=self.max_whitespace)

    def matcher(self, compiled: Any) -> Matcher:
        return Matcher(self._xgr, compiled, self._real_words, self._stop_words, self._forced)


class Matcher:
    """One request's position in its grammar: advanced by each token it accepts."""

    def __init__(self, xgr: Any, compiled: Any, real_words: Any, stop_words: Any, forced: ForcedBytes) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        self._forced = forced
        self._bitmask = real_words.clone()  # [1, ceil(vocab / 32)] int32, xgrammar's layout
        self._real_words = real_words  # the bits of the ids the tokenizer has
        self._not_stop = ~stop_words  # the bits of every id but the stop ids
        self._allowed: bytes | None = None  # the current position's mask, once computed
        self._probe_bitmask: Any = None  # scratch for forced_text's forks, made on first use
        self._probe_words: Any = None  # the same memory as a numpy [words] uint32 array

    def accept(self, token: int) -> bool:
        """Advance by token; False (and no change) if the grammar does not allow it."""
        self._allowed = None
        return bool(self._matcher.accept_token(token))

    def allowed(self) -> bytes:
        """The tokens allowed next, packed: bit j of little-endian int32 word w is token 32 * w + j."""
        if self._allowed is None:
            self._matcher.fill_next_token_bitmask(self._bitmask)
            self._bitmask &= self._real_words
            self._allowed = self._bitmask.numpy().tobytes()
        return self._allowed

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        self._allowed = None
        if n:
            self._matcher.rollback(n)

    def forced_text(self, limit: int) -> Forced:
        """At most `limit` bytes of the text the grammar allows as the only continuation from
        here ("" if none), as whole characters; computed incrementally (forced_text.py)."""
        if self._matcher.is_terminated():
            return Forced("", cut=False)
        allowed = numpy.frombuffer(self.allowed(), dtype=numpy.uint32)  # [words], the position's mask
        return self._forced.forced_text(self._matcher, allowed, self._fill, limit)

    def _fill(self, probe: Any) -> Any:
        """The packed mask at a forked matcher's position, a view of a scratch bitmask of our own.
        Not ANDed with the real ids: a padding id allowed means any text may follow, and padding
        ids have no first byte, so ForcedBytes forces nothing there either way."""
        if self._probe_bitmask is None:
            self._probe_bitmask = self._real_words.clone()
            self._probe_words = self._probe_bitmask.numpy().view("uint32")[0]  # [words], shares memory
        probe.fill_next_token_bitmask(self._probe_bitmask)
        return self._probe_words

    @property
    def longest_token(self) -> int:
        """Bytes in the vocabulary's longest token: n tokens never hold more than n times this."""
        return self._forced.longest

    @property
    def dead_end(self) -> bool:
        """Nothing can follow and the grammar is not complete: it accepts no string from here."""
        return not self._matcher.is_completed() and not self.allowed().strip(b"\0")

    @property
    def terminated(self) -> bool:
        """A stop token was accepted at the grammar's end."""
        return self._matcher.is_terminated()

    @property
    def finished(self) -> bool:
        """Nothing may follow: terminated, or the grammar is complete and allows only stop tokens."""
        if self.terminated:
            return True
        if not self._matcher.is_completed():
            return False
        self.allowed()
        return not bool((self._bitmask & self._not_stop).any())


def _words(ids: Iterable[int], vocab_size: int) -> Any:
    """A packed mask of ids, in xgrammar's bitmask layout: [1, ceil(vocab / 32)] int32, bit j of
    word w is id 32 * w + j."""
    import torch

    ids = numpy.fromiter(ids, dtype=numpy.int64)
    words = numpy.zeros(-(-vocab_size // 32), dtype=numpy.uint32)
    numpy.bitwise_or.at(words, ids // 32, (numpy.uint32(1) << (ids % 32).astype(numpy.uint32)))
    return torch.from_numpy(words.view(numpy.int32)).unsqueeze(0)


def _reason(e: Exception) -> str:
    """xgrammar's message without its C++ source location prefix."""
    text = str(e).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    if ".cc:" in text.split(" ", 1)[0]:
        text = text.split(" ", 1)[1] if " " in text else text
    return text.splitlines()[0] if text else type(e).__name__

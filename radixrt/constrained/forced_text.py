"""ForcedBytes: the text a grammar forces next, found one byte at a time and never past a bound.

xgrammar's own `find_jump_forward_string` walks the whole forced continuation before it
returns, with no bound: `root ::= "a" root` never returns (its memory grows until the
process dies) and `a{10000000}` takes seconds. Jump-forward only ever needs what the
request can still emit, so the scheduler asks for at most `limit` bytes and this module
finds them incrementally from the token masks the matcher already computes.

A byte is forced where every token the grammar allows next starts with it. That is exact
for the vocabularies xgrammar supports: every byte is covered by some token (byte-level
BPE, or byte fallback), so if two first bytes were possible, tokens starting with each
would be allowed. A stop token (or any token that decodes to nothing) among the allowed
ones means the text may end here: nothing is forced.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy

NO_BYTE = -1  # first_byte of a token that decodes to no bytes (special and stop tokens)


class Forced(NamedTuple):
    text: str  # whole UTF-8 characters the grammar forces next
    cut: bool  # the walk stopped at its limit: more may be forced after text


class ForcedBytes:
    """Per-vocabulary tables: each token's first byte, and per byte the packed mask of the tokens
    that do not start with it (built on first use: few bytes are ever forced)."""

    def __init__(self, decoded_vocab: Sequence[bytes], vocab_size: int, stop_ids: Sequence[int]) -> None:
        first = numpy.full(vocab_size, NO_BYTE, dtype=numpy.int16)  # [vocab] first byte per id
        for i, word in enumerate(decoded_vocab[:vocab_size]):
            if word:
                first[i] = word[0]
        first[list(stop_ids)] = NO_BYTE  # a stop token allowed means the text may end: never a forced byte
        self._first = first
        self.longest = max(map(len, decoded_vocab[:vocab_size]), default=1)  # bytes in the longest token
        self._words = -(-vocab_size // 32)
        self._others: dict[int, numpy.ndarray] = {}  # byte -> [words] uint32, ids not starting with it

    def next_byte(self, allowed: numpy.ndarray) -> int | None:
        """The byte every allowed token starts with, or None. allowed: [words] uint32, the packed
        mask (bit j of word w is id 32 * w + j)."""
        w = int((allowed != 0).argmax())  # the first word with an allowed id (0 if there is none)
        word = int(allowed[w])
        if word == 0:
            return None
        token = 32 * w + (word & -word).bit_length() - 1  # the lowest allowed id
        byte = int(self._first[token])
        if byte == NO_BYTE or (allowed & self._not_starting_with(byte)).any():
            return None
        return byte

    def _not_starting_with(self, byte: int) -> numpy.ndarray:
        if byte not in self._others:
            ids = numpy.flatnonzero(self._first == byte)
            mask = numpy.zeros(self._words, dtype=numpy.uint32)
            numpy.bitwise_or.at(mask, ids // 32, numpy.uint32(1) << (ids % 32).astype(numpy.uint32))
            self._others[byte] = ~mask
        return self._others[byte]

    def forced_text(self, matcher: Any, allowed: numpy.ndarray, fill: Any, limit: int) -> Forced:
        """At most `limit` bytes the grammar forces after matcher's position, as whole UTF-8
        characters. allowed: the position's packed mask; fill(probe) -> the mask at a fork's
        position. The matcher itself is not changed (the walk runs on a fork)."""
        out = bytearray()
        probe = None
        while len(out) < limit:
            byte = self.next_byte(allowed)
            if byte is None:
                break
            probe = probe or matcher.fork()
            if not probe.accept_string(bytes((byte,))):
                break
            out.append(byte)
            allowed = fill(probe)
        return Forced(whole_characters(bytes(out)), cut=len(out) >= limit)


def whole_characters(data: bytes) -> str:
    """data up to its first byte that does not complete a UTF-8 character (as xgrammar's own
    jump-forward string: a character forced only in part waits for the model)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        return data[: e.start].decode("utf-8")

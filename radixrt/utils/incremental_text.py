"""IncrementalDecoder: a growing output's text, decoded a few tokens at a time.

Decoding a token alone can differ from decoding it in context (a tokenizer that
drops a leading space, a character split across tokens), so each step decodes
from the previous piece's first token: the text of `ids[prefix:read]` is known,
and what `ids[prefix:]` adds to it is new. A decode that ends in an incomplete
UTF-8 character waits for the next token. Each call costs O(new tokens), not
O(output). The frontend's detokenizer and the scheduler's stop check share it.

skip_special_tokens and spaces_between_special_tokens go to the tokenizer's
decode, as SGLang's detokenizer passes them.
"""

from __future__ import annotations

from typing import Any

from radixrt.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"  # decoded from an incomplete UTF-8 sequence


class IncrementalDecoder:
    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self._prefix = 0  # ids before this only give context to the next decode
        self._read = 0  # ids before this are decoded into stable text

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.params.skip_special_tokens, clean_up_tokenization_spaces=False,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
        )

    def advance(self, ids: list[int]) -> str:
        """The stable text that ids (the whole output so far) add since the last call ('' while
        the last token ends in an incomplete character)."""
        prefix_text = self.decode(ids[self._prefix : self._read])
        full = self.decode(ids[self._prefix :])
        if len(full) > len(prefix_text) and not full.endswith(REPLACEMENT):
            self._prefix, self._read = self._read, len(ids)
            return full[len(prefix_text) :]
        return ""

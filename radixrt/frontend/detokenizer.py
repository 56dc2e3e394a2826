"""Text from output ids: incremental for streams, trimmed at stop strings and stop tokens.

Streams hold back any tail that could still become a stop string, so the
chunks a client joins always equal the final text.

skip_special_tokens and spaces_between_special_tokens go to the tokenizer's
decode, as SGLang's detokenizer passes them: a tokenizer that honours the
latter (transformers 4's Python tokenizers put spaces around added tokens)
does; fast (Rust) tokenizers ignore it, in SGLang as here.
"""

from __future__ import annotations

from typing import Any

from radixrt.messages import FinishReason
from radixrt.sampling_params import SamplingParams

REPLACEMENT = "\ufffd"  # decoded from an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.params = params
        self.text = ""  # decoded and stable
        self._prefix = 0  # ids before this only give context to the next decode
        self._read = 0  # ids before this are in self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.params.skip_special_tokens, clean_up_tokenization_spaces=False,
            spaces_between_special_tokens=self.params.spaces_between_special_tokens,
        )

    def update(self, ids: list[int]) -> str:
        """Advance over all of ids (the whole output so far); returns the stable text."""
        prefix_text = self._decode(ids[self._prefix : self._read])
        full = self._decode(ids[self._prefix :])
        if len(full) > len(prefix_text) and not full.endswith(REPLACEMENT):
            self.text += full[len(prefix_text) :]
            self._prefix, self._read = self._read, len(ids)
        return self.text

    def final_text(self, ids: list[int], finish: FinishReason | None) -> str:
        """The whole output's text, trimmed as the request finished."""
        if finish is not None and isinstance(finish.matched, int) and not self.params.no_stop_trim:
            ids = ids[:-1]  # the matched stop token is not part of the text
        return trim_stop(self._decode(ids), self.params)

    def stream_text(self, ids: list[int]) -> str:
        """Text safe to show mid-stream: stable, trimmed, with a possible stop-string start held back."""
        text = trim_stop(self.update(ids), self.params)
        return text[: len(text) - _stop_prefix_len(text, self.params.stop)]


def trim_stop(text: str, params: SamplingParams) -> str:
    if params.no_stop_trim or not params.stop:
        return text
    cuts = [i for i in (text.find(s) for s in params.stop) if i >= 0]
    return text[: min(cuts)] if cuts else text


def _stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best

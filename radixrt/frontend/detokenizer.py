"""Text from output ids: incremental for streams, trimmed at stop strings and stop tokens.

Streams hold back any tail that could still become a stop string, so the
chunks a client joins always equal the final text. The stop strings are looked
for with an automaton fed only each update's new text (radixrt/utils/stop_strings.py),
so a stream's update costs O(new text), whatever the number of stop strings.

skip_special_tokens and spaces_between_special_tokens go to the tokenizer's
decode, as SGLang's detokenizer passes them: a tokenizer that honours the
latter (transformers 4's Python tokenizers put spaces around added tokens)
does; fast (Rust) tokenizers ignore it, in SGLang as here.
"""

from __future__ import annotations

from typing import Any

from radixrt.messages import FinishReason
from radixrt.sampling_params import SamplingParams
from radixrt.utils.incremental_text import IncrementalDecoder
from radixrt.utils.stop_strings import StopScan, StopStrings


class IncrementalDetokenizer(IncrementalDecoder):
    def __init__(self, tokenizer: Any, params: SamplingParams, stops: StopStrings | None = None) -> None:
        """stops: the automaton of params.stop, when the caller has it built (else built here, if needed)."""
        super().__init__(tokenizer, params)
        self.text = ""  # decoded and stable
        self.stops = stops if stops is not None or not params.stop else StopStrings(params.stop)
        self._scan = StopScan(self.stops) if self.stops is not None else None

    def update(self, ids: list[int]) -> str:
        """Advance over all of ids (the whole output so far); returns the stable text."""
        self.text += self.advance(ids)
        return self.text

    def final_text(self, ids: list[int], finish: FinishReason | None) -> str:
        """The whole output's text, trimmed as the request finished."""
        if finish is not None and isinstance(finish.matched, int) and not self.params.no_stop_trim:
            ids = ids[:-1]  # the matched stop token is not part of the text
        return trim_stop(self.decode(ids), self.params, self.stops)

    def stream_text(self, ids: list[int]) -> str:
        """Text safe to show mid-stream: stable, trimmed, with a possible stop-string start held back."""
        text = self.update(ids)
        scan = self._scan
        if scan is None:
            return text
        scan.feed(text[scan.pos :])
        if scan.first is None or self.params.no_stop_trim:
            return text[: len(text) - scan.held]
        text = text[: scan.first]  # a stop string that did not end the request (before min_new_tokens)
        return text[: len(text) - self.stops.held_after(text)]


def trim_stop(text: str, params: SamplingParams, stops: StopStrings | None = None) -> str:
    """text cut where its first stop string starts (unless no_stop_trim). stops: params.stop's automaton."""
    if params.no_stop_trim or not params.stop:
        return text
    cut = (stops or StopStrings(params.stop)).first_start(text)
    return text if cut is None else text[:cut]

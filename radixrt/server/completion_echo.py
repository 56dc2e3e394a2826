"""/v1/completions with `echo`: each choice's text starts with its prompt's.

As in SGLang (and OpenAI), a text prompt is echoed as sent and a token-id prompt as its ids
decoded without special tokens; choice i echoes prompt i // n. With `logprobs`, the request
asks for every prompt token's logprob (logprob_start_len 0), and the prompt's tokens come first
in the choice's logprobs: the first token has no logprob and no top alternatives (None), and
text_offset runs on over the echoed text into the completion's. A stream sends the prompt in
each choice's first chunk, and with logprobs not before its logprobs have come back.

Unlike SGLang 0.5.9, `logprobs: 0` with echo also returns the prompt's logprobs (SGLang asks
for them only when logprobs is nonzero), and text_offset is filled in (SGLang sends -1).
"""

from __future__ import annotations

from typing import Any

from radixrt.frontend.req_state import ReqState
from radixrt.server.openai_responses import (
    completion_choice,
    legacy_logprobs,
    text_offsets,
)


class EchoView:
    """A ChoiceView (openai_responses) for completions with echo."""

    def __init__(self, prompt: Any, n: int, logprobs: int | None) -> None:
        """prompt: the request's (a text, texts, ids or id lists); n: samples per prompt;
        logprobs: the request's (top alternatives per token, or None for no logprobs)."""
        self._prompt, self._n, self._top = prompt, n, logprobs
        self._texts: dict[int, str] = {}  # prompt index -> its echo, decoded once
        self._echoed: set[int] = set()  # choices whose prompt went out (a stream's first chunk)

    def ready(self, index: int, state: ReqState) -> bool:
        """Whether a stream may send choice `index`'s next chunk: its first carries the prompt's
        logprobs, which come back with the prompt's last step (the first output token)."""
        if self._top is None or index in self._echoed:
            return True
        # NOTE: the receiving thread sets input_logprobs, then input_top: wait for both
        return bool(state.input_logprobs) and (self._top == 0 or state.input_top is not None)

    def __call__(self, tok: Any, state: ReqState, index: int, text: str, logprobs: tuple[int, int] | None,
                 stream: bool) -> dict[str, Any]:
        choice = completion_choice(tok, state, index, text, logprobs, stream)
        echo = self.echo_text(tok, index)
        out = choice["logprobs"]
        if out is not None:  # the completion's text follows the echo
            out["text_offset"] = [o + len(echo) for o in out["text_offset"]]
        if index in self._echoed:  # a stream's later chunk
            return choice
        self._echoed.add(index)
        choice["text"] = echo + choice["text"]
        if out is not None:
            prompt = prompt_logprobs(tok, state)
            choice["logprobs"] = {k: prompt[k] + out[k] for k in out}
        return choice

    def echo_text(self, tok: Any, index: int) -> str:
        """The text choice `index` echoes: its prompt as sent, or its ids decoded."""
        i = index // self._n
        if i not in self._texts:
            p = self._prompt
            if isinstance(p, str):
                self._texts[i] = p
            elif isinstance(p[0], int):  # one token-id prompt
                self._texts[i] = tok.decode(p, skip_special_tokens=True)
            elif isinstance(p[i], list):
                self._texts[i] = tok.decode(p[i], skip_special_tokens=True)
            else:
                self._texts[i] = p[i]
        return self._texts[i]


def prompt_logprobs(tok: Any, state: ReqState) -> dict[str, Any]:
    """The prompt's tokens as completions logprobs, offsets from 0. A special token takes no
    width: the echo leaves it out (a text prompt never shows the BOS the tokenizer added, and a
    token-id prompt is decoded without them)."""
    meta = state.result(tok)["meta_info"]
    tokens = meta["input_token_logprobs"]
    # without top alternatives (logprobs 0): None for the first token, as with them, then none
    tops = meta["input_top_logprobs"] or [None] + [[] for _ in tokens[1:]]
    special = set(tok.all_special_ids)
    widths = ["" if t[1] in special else t[2] for t in tokens]
    return legacy_logprobs(tokens, tops, text_offsets(widths))

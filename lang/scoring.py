"""How select scores a choice: the mean log-prob of the choice's own tokens.

The server scores `prefix + choice` as one prompt, so the choice's tokens are
whatever the tokenizer makes of the joined text. NOTE: at the boundary BPE may
merge the prefix's last characters with the choice's first (prefix "is ",
choice "yes" -> one token " yes"). Our rule, deliberately: a token belongs to
the choice when it covers at least one character of the choice, so a token that
straddles the boundary counts as the choice's first token (it is the token the
model must emit to start this choice; dropping it would score a multi-token
choice on its tail only, and a one-token choice on nothing).

We place tokens by their text (the server returns each token's text with
`return_text_in_logprobs`), walking back from the end of `prefix + choice`.
When the texts cannot be trusted to line up (a token that is part of a UTF-8
character decodes to U+FFFD), we fall back to counting: the last
`max(len(prefix+choice tokens) - len(prefix tokens), 1)` tokens, which is exact
whenever the boundary did not merge.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

# One input_token_logprobs entry: [logprob or None, token id, token text or None].
Entry = Sequence[Any]


def choice_entries(prefix: str, choice: str, entries: Sequence[Entry], prefix_tokens: int,
                   full_tokens: int) -> list[Entry]:
    """The entries (from the server's input_token_logprobs of prefix+choice) that are the choice's tokens."""
    full = prefix + choice
    texts = [e[2] for e in entries]
    if all(isinstance(t, str) and "\ufffd" not in t for t in texts) and full.endswith("".join(texts)):
        picked, end = [], len(full)
        for entry in reversed(entries):
            if end <= len(prefix):  # this token ends inside the prefix: no choice character in it
                break
            picked.append(entry)
            end -= len(entry[2])
        return picked[::-1]
    return list(entries[-max(full_tokens - prefix_tokens, 1):])


def mean_logprob(entries: Sequence[Entry]) -> float:
    """Token-length-normalized log-prob; a token with no log-prob (the prompt's first) is left out."""
    values = [e[0] for e in entries if e[0] is not None]
    return sum(values) / len(values) if values else -math.inf


def best_choice(scores: Sequence[float]) -> int:
    """Index of the highest score; the earliest choice wins a tie."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))

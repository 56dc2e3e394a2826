"""How select scores one choice: SGLang's frontend arithmetic over the server's prompt logprobs.

select first sends the prefix alone (prefill-only), which caches it and tells its
token count P; then prefix+choice for every choice in one batch, with prompt
logprobs from position `logprob_start(P)` = max(P - 2, 0) on. For each choice the
server answers `input_token_logprobs`: one entry [logprob, token id, token text]
per prompt token from that position on. SGLang's frontend then

1. averages the entries' logprobs, leaving out the falsy ones (None, and an exact
   0.0, as SGLang's `if x[0]` does);
2. "token healing": when the prefix text ends with the first entry's text, that
   entry is taken back out of the average, `(mean * n - lp) / (n - 1)`, and out of
   the entries.

NOTE: so the score usually covers the prefix's last token or two as well as the
choice's own tokens (a radixrt server gives the start position a logprob; an
SGLang server gives it None, so there only the last prefix token joins in). Those
tokens are the same for every choice unless BPE merges across the boundary, and
they weigh more on short choices than on long ones. We keep the rule anyway:
programs must pick what SGLang's frontend picks on the same server.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

# One input_token_logprobs entry: [logprob or None, token id, token text or None].
Entry = Sequence[Any]


def logprob_start(prefix_tokens: int) -> int:
    """The first prompt position whose logprob the scoring request asks for: two tokens of slack
    before the boundary, so a choice whose first token merged into the prefix's last is covered."""
    return max(prefix_tokens - 2, 0)


@dataclass(frozen=True)
class ChoiceScore:
    normalized: float  # normalized_prompt_logprob
    entries: list[Entry]  # the entries the score stands for (after the healing step)


def normalized_logprob(entries: Sequence[Entry]) -> float:
    """The mean of the entries' truthy logprobs (SGLang's compute_normalized_prompt_logprobs)."""
    values = [e[0] for e in entries if e[0]]
    if not values:
        raise ValueError(f"no token with a logprob to score in {list(entries)!r}")
    return sum(values) / len(values)


def score_choice(prefix: str, entries: Sequence[Entry]) -> ChoiceScore:
    """The normalized logprob of one choice from the server's input_token_logprobs of prefix+choice."""
    mean, entries = normalized_logprob(entries), list(entries)
    first_lp, first_text = entries[0][0], entries[0][-1]
    if not (isinstance(first_text, str) and prefix.endswith(first_text)):
        return ChoiceScore(mean, entries)
    if first_lp is None:
        # SGLang's arithmetic fails here (it subtracts None); the entry was never counted, so the mean stands.
        return ChoiceScore(mean, entries[1:])
    if len(entries) == 1:
        raise ValueError(f"the only token to score, {first_text!r}, is part of the prefix")
    return ChoiceScore((mean * len(entries) - first_lp) / (len(entries) - 1), entries[1:])

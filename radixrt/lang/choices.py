"""How select decides among scored choices: SGLang's three choices methods.

`select(..., choices_method=...)` takes one of the instances at the bottom. The
backend scores every choice (scoring.py) and hands the method a ScoredChoices;
the method returns the chosen index and the select's meta_info. Plain Python:
the DSL does not need numpy.

- token_length_normalized (the default): the highest normalized logprob.
- greedy_token_selection: compare the choices token by token, keeping those with
  the best logprob at each position; a shorter choice is padded with its own mean.
- unconditional_likelihood_normalized: the highest mean of (conditional minus
  unconditional) logprobs, the unconditional ones from scoring each choice's tokens
  alone. NOTE: SGLang's request for those asks no logprob_start_len, so the server
  answers one entry per choice (the last token's), and SGLang subtracts that one
  value from every token (numpy broadcasting); we do the same arithmetic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

from .scoring import Entry


@dataclass(frozen=True)
class ScoredChoices:
    choices: Sequence[str]
    normalized_prompt_logprobs: list[float]
    input_token_logprobs: list[list[Entry]]  # per choice, after the healing step (scoring.py)
    output_token_logprobs: list[list[Entry]]
    unconditional_token_logprobs: list[list[Entry]] | None = None  # only for methods that ask for them

    def meta(self) -> dict[str, Any]:
        return {"normalized_prompt_logprobs": self.normalized_prompt_logprobs,
                "input_token_logprobs": self.input_token_logprobs,
                "output_token_logprobs": self.output_token_logprobs}


@dataclass(frozen=True)
class ChoicesDecision:
    index: int  # into the choices
    meta: dict[str, Any]


class ChoicesMethod(ABC):
    """Picks one choice. Pure: reads the scores, never calls the server."""

    requires_unconditional_logprobs: bool = False

    @abstractmethod
    def __call__(self, scored: ScoredChoices) -> ChoicesDecision: ...

    def __repr__(self) -> str:
        return type(self).__name__


def first_argmax(values: Sequence[float]) -> int:
    """Index of the highest value; the earliest wins a tie (numpy's argmax)."""
    return max(range(len(values)), key=lambda i: (values[i], -i))


def _logprobs(entries: Sequence[Entry], method: str) -> list[float]:
    values = [e[0] for e in entries]
    if any(v is None for v in values):
        raise ValueError(f"{method} needs a logprob for every token; got None in {list(entries)!r}")
    return values


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


class TokenLengthNormalized(ChoicesMethod):
    def __call__(self, scored: ScoredChoices) -> ChoicesDecision:
        return ChoicesDecision(first_argmax(scored.normalized_prompt_logprobs), scored.meta())


class GreedyTokenSelection(ChoicesMethod):
    def __call__(self, scored: ScoredChoices) -> ChoicesDecision:
        rows = [_logprobs(option, "greedy_token_selection") for option in scored.input_token_logprobs]
        width = max(len(row) for row in rows)
        matrix = [row + [_mean(row)] * (width - len(row)) for row in rows]  # [choices, width]
        remaining = list(range(len(rows)))
        for j in range(width):
            best = max(matrix[i][j] for i in remaining)
            remaining = [i for i in remaining if matrix[i][j] == best]
            if len(remaining) == 1:
                break
        return ChoicesDecision(remaining[0], {**scored.meta(), "greedy_logprob_matrix": matrix})


class UnconditionalLikelihoodNormalized(ChoicesMethod):
    requires_unconditional_logprobs = True

    def __call__(self, scored: ScoredChoices) -> ChoicesDecision:
        if scored.unconditional_token_logprobs is None:
            raise ValueError("unconditional_likelihood_normalized needs the unconditional token logprobs")
        means = [self._mean_gain(inputs, alone) for inputs, alone
                 in zip(scored.input_token_logprobs, scored.unconditional_token_logprobs)]
        meta = {**scored.meta(), "unconditional_token_logprobs": scored.unconditional_token_logprobs,
                "normalized_unconditional_prompt_logprobs": means}
        return ChoicesDecision(first_argmax(means), meta)

    @staticmethod
    def _mean_gain(inputs: Sequence[Entry], alone: Sequence[Entry]) -> float:
        conditional = _logprobs(inputs, "unconditional_likelihood_normalized")
        unconditional = [e[0] for e in alone]
        unconditional[0] = unconditional[0] or 0.0  # the unconditional prompt's first token has no logprob
        unconditional = _logprobs([[v] for v in unconditional], "unconditional_likelihood_normalized")
        if len(unconditional) == 1:  # numpy broadcasting, as SGLang computes it
            unconditional = unconditional * len(conditional)
        elif len(conditional) == 1:
            conditional = conditional * len(unconditional)
        if len(conditional) != len(unconditional):
            raise ValueError(f"{len(conditional)} conditional and {len(unconditional)} unconditional logprobs")
        return _mean([c - u for c, u in zip(conditional, unconditional)])


token_length_normalized = TokenLengthNormalized()
greedy_token_selection = GreedyTokenSelection()
unconditional_likelihood_normalized = UnconditionalLikelihoodNormalized()

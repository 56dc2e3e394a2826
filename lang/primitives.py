"""The DSL's building blocks: gen, select and the chat roles."""

from __future__ import annotations

import re
from typing import Any, Sequence

from .ir import Expr, Gen, GenParams, Role, Select, to_expr


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    regex: str | None = None,
) -> Gen:
    """Generate text into variable `name`. Unset settings come from run()'s defaults.

    Inside an assistant role the chat template's end-of-turn string is added to `stop`.
    `regex` is checked to compile here and then passed to the server unchanged.
    """
    if regex is not None:
        re.compile(regex)  # a typo fails here, not as a confusing server error
    params = GenParams.build(
        max_new_tokens=max_tokens, stop=stop, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, regex=regex,
    )
    return Gen(name, params)


def select(name: str | None = None, choices: Sequence[str] = ()) -> Select:
    """Append the choice the model finds most likely (mean log-prob per token) and store it in `name`."""
    choices = tuple(choices)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select needs at least one choice, each a non-empty string")
    return Select(name, choices)


def system(content: Any) -> Role:
    return Role("system", to_expr(content))


def user(content: Any) -> Role:
    return Role("user", to_expr(content))


def assistant(content: Any) -> Role:
    return Role("assistant", to_expr(content))


__all__ = ["gen", "select", "system", "user", "assistant", "Expr"]

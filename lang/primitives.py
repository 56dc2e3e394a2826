"""The DSL's building blocks: gen, select and the chat roles."""

from __future__ import annotations

from typing import Any, Sequence

from .constraints import at_most_one, dtype_rule
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
    json_schema: dict[str, Any] | str | None = None,
    choices: Sequence[str] | None = None,
    dtype: type | str | None = None,
) -> Gen | Select:
    """Generate text into variable `name`. Unset settings come from run()'s defaults.

    Inside an assistant role the chat template's end-of-turn string is added to `stop`.
    At most one constraint on the output (ValueError otherwise), checked here and enforced by the server:
    `regex` (must compile); `json_schema` (a dict, sent as json.dumps of it, or a JSON string, sent
    unchanged); `dtype` (int, float, bool or str, or its name: a regex from constraints.py; int and
    float also stop at a space or newline); `choices`: the same as `select(name, choices)`, which
    scores the choices instead of sampling, so the sampling settings do not apply.
    """
    at_most_one(regex=regex, json_schema=json_schema, choices=choices, dtype=dtype)
    if choices is not None:
        return select(name, choices)
    rule = dtype_rule(dtype) if dtype is not None else None
    params = GenParams.build(
        max_new_tokens=max_tokens, stop=stop, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, regex=rule.regex if rule else regex, json_schema=json_schema,
    )
    if rule and rule.stop:
        params = params.with_stop(rule.stop)
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

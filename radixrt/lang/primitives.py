"""The DSL's building blocks: gen, select, the chat roles and separate_reasoning."""

from __future__ import annotations

from typing import Any, Sequence

from radixrt.reasoning import get_format

from .choices import ChoicesMethod, token_length_normalized
from .constraints import at_most_one, dtype_rule
from .ir import Expr, ExprList, Gen, GenParams, Role, Select, SeparateReasoning, check_lora_path, to_expr


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_regex: str | Sequence[str] | None = None,
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
    choices_method: ChoicesMethod = token_length_normalized,
    lora_path: str | None = None,
) -> Gen | Select:
    """Generate text into variable `name`. Unset settings come from run()'s defaults.

    The chat template's end-of-turn strings are added to `stop` (in every gen, as SGLang does);
    `stop_regex` patterns (Python re) end the gen where one matches, keeping the matched text.
    At most one constraint on the output (ValueError otherwise), checked here and enforced by the server:
    `regex` (must compile); `json_schema` (a dict, sent as json.dumps of it, or a JSON string, sent
    unchanged); `dtype` (int, float, bool or str, or its name: a regex from constraints.py; int and
    float also stop at a space or newline); `choices`: the same as `select(name, choices)`, which
    scores the choices (by `choices_method`) instead of sampling: temperature must be unset or 0.
    `lora_path` names the LoRA adapter this gen runs on (unset: run()'s `lora_path`, else the base model).
    """
    at_most_one(regex=regex, json_schema=json_schema, choices=choices, dtype=dtype)
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method, lora_path)
    rule = dtype_rule(dtype) if dtype is not None else None
    params = GenParams.build(
        max_new_tokens=max_tokens, stop=stop, stop_regex=stop_regex, temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
        frequency_penalty=frequency_penalty, presence_penalty=presence_penalty, ignore_eos=ignore_eos,
        return_logprob=return_logprob, regex=rule.regex if rule else regex, json_schema=json_schema,
        lora_path=lora_path,
    )
    if rule and rule.stop:
        params = params.with_stop(rule.stop)
    return Gen(name, params)


def select(name: str | None = None, choices: Sequence[str] = (), temperature: float = 0.0,
           choices_method: ChoicesMethod = token_length_normalized, lora_path: str | None = None) -> Select:
    """Append the choice the model finds most likely and store it in `name`.

    Every choice is scored by its prompt logprobs after the text so far (scoring.py) and
    `choices_method` (choices.py) decides; the default takes the best mean logprob per token.
    Scoring never samples, so `temperature` is there for SGLang's signature and must be 0.
    `lora_path` names the LoRA adapter that scores (unset: run()'s `lora_path`, else the base model).
    """
    choices = tuple(choices)
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise ValueError("select needs at least one choice, each a non-empty string")
    if temperature > 1e-5:
        raise ValueError(f"select scores every choice and takes the best; it does not sample (temperature={temperature})")
    if not isinstance(choices_method, ChoicesMethod):
        raise TypeError(f"choices_method must be one of radixrt.lang's choices methods, got {choices_method!r}")
    check_lora_path(lora_path)
    return Select(name, choices, choices_method, lora_path)


def separate_reasoning(expr: Any, model_type: str | None = None) -> SeparateReasoning:
    """SGLang's: after each gen or select in `expr` (each named), its variable holds the content and
    `<name>_reasoning_content` the reasoning, split by the named format (radixrt.reasoning's names,
    forced as outside chat: deepseek-r1 reasons from the start, qwen3 from a `<think>`). The text
    keeps only the content. In a streamed run the text is left whole, as SGLang leaves it."""
    if model_type is None:
        raise ValueError("separate_reasoning needs a model_type (a reasoning parser's name)")
    get_format(model_type)  # ValueError naming the choices
    expr = to_expr(expr)
    _check_named(expr)
    return SeparateReasoning(expr, model_type)


def _check_named(expr: Expr) -> None:
    if isinstance(expr, (Gen, Select)) and not expr.name:
        raise ValueError("separate_reasoning needs a named gen or select: its reasoning goes to <name>_reasoning_content")
    if isinstance(expr, ExprList):
        for item in expr.items:
            _check_named(item)


def system(content: Any) -> Role:
    return Role("system", to_expr(content))


def user(content: Any) -> Role:
    return Role("user", to_expr(content))


def assistant(content: Any) -> Role:
    return Role("assistant", to_expr(content))


__all__ = ["gen", "select", "separate_reasoning", "system", "user", "assistant", "Expr"]

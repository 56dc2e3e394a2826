"""The program's expressions: what `s += ...` submits to a state's executor.

Expressions are plain data; the executor (executor.py) gives them meaning.
`expr + "text"` and `"text" + expr` build an ExprList, so a line like
`s += "Q: " + rt.gen("q")` is one submission.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from .choices import ChoicesMethod, token_length_normalized
from .constraints import at_most_one, check_regex, schema_text


class Expr:
    """Base of every expression; supports concatenation with `+`."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList((self, to_expr(other)))

    def __radd__(self, other: Any) -> ExprList:
        return ExprList((to_expr(other), self))


CONSTRAINT_FIELDS = ("regex", "json_schema")  # GenParams' output constraints
REQUEST_FIELDS = ("return_logprob", "lora_path")  # GenParams' fields sent beside sampling_params, not in it


def check_lora_path(lora_path: Any) -> None:
    """A LoRA adapter is chosen by its name as the server registered it (or None: not set here)."""
    if lora_path is not None and not (isinstance(lora_path, str) and lora_path):
        raise TypeError(f"lora_path must be an adapter's name (a non-empty string) or None, got {lora_path!r}")


@dataclass(frozen=True)
class GenParams:
    """The settings of one gen (sampling, output constraint, LoRA adapter); None means "not set
    here" (the program default applies)."""

    max_new_tokens: int | None = None
    stop: tuple[str, ...] | None = None
    stop_regex: tuple[str, ...] | None = None  # SGLang's: the gen ends where one of these patterns matches
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    return_logprob: bool | None = None
    # The output's constraint, at most one (constraints.py): passed through to the server.
    regex: str | None = None
    json_schema: str | None = None  # a JSON Schema as a JSON string (SGLang's form)
    # The LoRA adapter's name: /generate's top-level `lora_path`, not a sampling parameter.
    lora_path: str | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    @classmethod
    def build(cls, **values: Any) -> GenParams:
        for key in ("stop", "stop_regex"):
            given = values.get(key)
            if isinstance(given, str):
                values[key] = (given,)
            elif given is not None:
                values[key] = tuple(given)
        for pattern in values.get("stop_regex") or ():
            check_regex(pattern)
        at_most_one(regex=values.get("regex"), json_schema=values.get("json_schema"))
        if values.get("regex") is not None:
            check_regex(values["regex"])
        if values.get("json_schema") is not None:
            values["json_schema"] = schema_text(values["json_schema"])
        check_lora_path(values.get("lora_path"))
        return cls(**values)

    def over(self, defaults: GenParams) -> GenParams:
        """These settings, with the unset ones taken from `defaults`. A constraint set here replaces
        the default's of any kind (a run-wide regex and a gen's json_schema would be two)."""
        mine = {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}
        if any(name in mine for name in CONSTRAINT_FIELDS):
            defaults = replace(defaults, **dict.fromkeys(CONSTRAINT_FIELDS))
        return replace(defaults, **mine)

    def with_stop(self, extra: tuple[str, ...]) -> GenParams:
        """These settings with `extra` after the stop strings already set (each string once)."""
        if not extra:
            return self
        stops = tuple(self.stop or ())
        return replace(self, stop=stops + tuple(s for s in extra if s not in stops))

    def sampling_params(self) -> dict[str, Any]:
        """The server's `sampling_params` object (unset fields left to the server)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in REQUEST_FIELDS}
        for key in ("stop", "stop_regex"):
            if out[key] is not None:
                out[key] = list(out[key])
        return {k: v for k, v in out.items() if v is not None}


# The program-level default when neither gen nor run sets it (SGLang's run default).
DEFAULT_PARAMS = GenParams(max_new_tokens=128)


@dataclass(frozen=True, eq=False)
class Text(Expr):
    value: str


@dataclass(frozen=True, eq=False)
class Gen(Expr):
    name: str | None
    params: GenParams = field(default_factory=GenParams)


@dataclass(frozen=True, eq=False)
class Select(Expr):
    name: str | None
    choices: tuple[str, ...]
    method: ChoicesMethod = token_length_normalized
    lora_path: str | None = None  # None: the program's default adapter (run(lora_path=...)), if any


@dataclass(frozen=True, eq=False)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class RoleEnd(Expr):
    role: str


@dataclass(frozen=True, eq=False)
class Role(Expr):
    """`rt.user(content)`: begin the role, the content, end the role."""

    role: str
    content: Expr


@dataclass(frozen=True, eq=False)
class ExprList(Expr):
    items: tuple[Expr, ...]


@dataclass(frozen=True, eq=False)
class SeparateReasoning(Expr):
    """`rt.separate_reasoning(expr, model_type)`: each named gen or select in expr keeps only its
    content (in its variable and the text) and puts its reasoning in `<name>_reasoning_content`."""

    expr: Expr
    model_type: str  # a radixrt.reasoning format name


@dataclass(frozen=True, eq=False)
class CachePrefix(Expr):
    """Internal (fork): send the text so far as a prefill-only request, so branches find it cached."""


def to_expr(value: Any) -> Expr:
    """A str, an expression, or a list/tuple of those, as one expression."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    if isinstance(value, (list, tuple)):
        return ExprList(tuple(to_expr(v) for v in value))
    raise TypeError(f"cannot add a {type(value).__name__} to a program (use str or an rt expression)")

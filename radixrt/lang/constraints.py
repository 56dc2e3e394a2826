"""Constrained generation in the DSL: what gen's regex / json_schema / choices / dtype become.

The server does the constraining (its `sampling_params.regex` / `json_schema`); this
module only checks a constraint where the program defines it and turns a dtype into a
regex, so a typo fails at the line that wrote it, not as a server error later.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# The dtype regexes follow SGLang's frontend (same languages, our spelling). int and float
# allow trailing spaces/newlines and stop on them: a random or unsure model can then end the
# number with a space, and the stop string trims it, instead of adding digits until max_tokens.
REGEX_INT = r"[-+]?[0-9]+[ \n]*"
REGEX_FLOAT = r"[-+]?([0-9]+(\.[0-9]+)?|\.[0-9]+)[ \n]*"
REGEX_BOOL = r"(True|False)"  # Python's spelling, as SGLang
REGEX_STR = r'"[\w\s]*"'  # a quoted string of word characters and whitespace (no escapes)
NUMBER_STOPS = (" ", "\n")


@dataclass(frozen=True)
class DtypeRule:
    """What `gen(dtype=...)` sends: a regex, and stop strings added to the gen's own."""

    regex: str
    stop: tuple[str, ...] = ()


DTYPE_RULES: dict[str, DtypeRule] = {
    "int": DtypeRule(REGEX_INT, NUMBER_STOPS),
    "float": DtypeRule(REGEX_FLOAT, NUMBER_STOPS),
    "bool": DtypeRule(REGEX_BOOL),
    "str": DtypeRule(REGEX_STR),
}


def dtype_rule(dtype: Any) -> DtypeRule:
    """The rule for int, float, bool or str (the type or its name); ValueError for anything else."""
    name = dtype.__name__ if dtype in (int, float, bool, str) else dtype
    if not isinstance(name, str) or name not in DTYPE_RULES:
        raise ValueError(f"gen's dtype must be int, float, bool or str (or its name), not {dtype!r}")
    return DTYPE_RULES[name]


def at_most_one(**constraints: Any) -> None:
    """ValueError naming the constraints set (not None) when there are two or more."""
    given = [name for name, value in constraints.items() if value is not None]
    if len(given) > 1:
        raise ValueError(f"a gen takes at most one of {', '.join(constraints)}; got {' and '.join(given)}")


def check_regex(regex: str) -> str:
    try:
        re.compile(regex)
    except re.error as e:
        raise ValueError(f"regex {regex!r} does not compile: {e}") from e
    return regex


def schema_text(schema: dict[str, Any] | str) -> str:
    """The JSON Schema as the JSON string the server takes: a dict serialized, a string checked to
    parse as a JSON object and passed unchanged."""
    if isinstance(schema, dict):
        try:
            return json.dumps(schema)
        except (TypeError, ValueError) as e:
            raise ValueError(f"json_schema is not JSON-serializable: {e}") from e
    if not isinstance(schema, str):
        raise ValueError(f"json_schema must be a dict or a JSON string, not {type(schema).__name__}")
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from e
    if not isinstance(parsed, dict):
        raise ValueError(f"json_schema must be a JSON object, got {type(parsed).__name__}")
    return schema

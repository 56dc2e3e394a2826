"""Constrained decoding: jump-forward, and the whitespace JSON-schema constraints allow."""

from __future__ import annotations

import re
from dataclasses import dataclass

from radixrt.settings.fields import arg

# The whitespace constrained JSON allows between its tokens (xgrammar's max_whitespace_cnt) unless
# set: SGLang allows any, and a random-weight model then spends its budget on newlines. From
# bench/json_whitespace.py (tiny llama and qwen2, 3 schemas, 30 seeded runs each, 200 tokens): valid
# JSON in 43% of runs compact, 48/54/46/48% at bounds 1/2/3/4, 39% at 8 and 20% with any (runs of up
# to 164 whitespace characters); mean tokens grow with the bound (108 compact, 140 at 4, 177 any).
# 4 is the largest bound that ends as often as the smallest, and it still lets a model pretty-print:
# a newline and three spaces (indent 2 one level deep) or three tabs.
JSON_MAX_WHITESPACE = 4
# SGLang's --constrained-json-whitespace-pattern, in the one form that maps onto the bound: a class of
# JSON whitespace (literal, or escaped \n \t \r \s) repeated {0,n} times, or * (any number).
_JSON_WHITESPACE_PATTERN = re.compile(r"\[(?:\\[ntrs]|[ \n\t\r])+\](?:\{0,(?P<n>\d+)\}|\*)")


@dataclass(frozen=True)
class ConstrainedArgs:
    disable_jump_forward: bool = arg(
        False, "sample every token of a constrained output, even where its grammar allows only one continuation"
    )
    constrained_json_disable_any_whitespace: bool = arg(
        False, "JSON-schema constraints allow no whitespace between tokens (compact JSON) instead of any"
    )
    constrained_json_max_whitespace: int = arg(
        JSON_MAX_WHITESPACE, "JSON-schema constraints allow at most this many whitespace characters (space, "
        "newline, tab, carriage return) between JSON tokens: -1 any number (SGLang's default), 0 compact JSON (as "
        "--constrained-json-disable-any-whitespace)"
    )
    constrained_json_whitespace_pattern: str | None = arg(
        None, "SGLang's whitespace regex, accepted in the form [chars]{0,n} (or [chars]* for any number): it sets the "
        "bound n of --constrained-json-max-whitespace; the characters stay JSON's four (xgrammar cannot narrow them)"
    )

    def check(self) -> None:
        if self.constrained_json_max_whitespace < -1:
            raise ValueError("constrained_json_max_whitespace must be -1 (any), 0 (compact) or a bound >= 1, "
                             f"got {self.constrained_json_max_whitespace}")
        if self.constrained_json_whitespace_pattern is None:
            return
        json_whitespace_bound(self.constrained_json_whitespace_pattern)  # ValueError naming the flag
        if self.constrained_json_disable_any_whitespace or self.constrained_json_max_whitespace != JSON_MAX_WHITESPACE:
            raise ValueError("constrained_json_whitespace_pattern sets the same bound as constrained_json_max_whitespace "
                             "and constrained_json_disable_any_whitespace: give one of them")

    @property
    def json_max_whitespace(self) -> int | None:
        """Whitespace characters allowed between the tokens of JSON under a json_schema: None any
        number, 0 none (compact JSON), n at most n in a row."""
        if self.constrained_json_disable_any_whitespace:
            return 0
        if self.constrained_json_whitespace_pattern is not None:
            return json_whitespace_bound(self.constrained_json_whitespace_pattern)
        return None if self.constrained_json_max_whitespace == -1 else self.constrained_json_max_whitespace


def json_whitespace_bound(pattern: str) -> int | None:
    """The bound SGLang's whitespace pattern sets: n for [chars]{0,n}, None (any) for [chars]*.
    The characters must be JSON whitespace; xgrammar allows all four wherever one is allowed.
    Raises ValueError naming the flag for any other pattern."""
    match = _JSON_WHITESPACE_PATTERN.fullmatch(pattern)
    if match is None:
        raise ValueError(f"constrained_json_whitespace_pattern must be [chars]{{0,n}} or [chars]* with chars among "
                         f"space, \\n, \\t, \\r and \\s (xgrammar bounds the count, not the pattern), got {pattern!r}")
    return None if match["n"] is None else int(match["n"])

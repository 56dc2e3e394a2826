r"""StopRegexScan: where a growing text first matches one of a request's stop_regex patterns.

SGLang's stop_regex: after each token the output's text is searched with Python's `re`, and
a match ends the request (the text keeps the match; its finish reason names the pattern).
A match that ends in text already scanned would have ended the request then, so each call
searches only from where a match could still begin: a pattern that matches at most `w`
characters starts its search `w` characters before the new text, and costs O(w + new text).
An unbounded pattern (`\d+`, `.*`) is searched from the start of the text each time, as SGLang
searches its whole output: O(output) per step.

Python's `re` backtracks, and the scheduler runs the search between steps: a pattern with a
variable repeat inside an unbounded one (`(a+)+b`, `(\w+\s)*x`) can take exponential time on an
output that nearly matches, and would stall every request. `nested_repeat` finds those, and
the sampling params refuse them (SGLang runs them as they are).
"""

from __future__ import annotations

import re
from re import _parser as sre_parse  # type: ignore[attr-defined]

UNBOUNDED = 1 << 16  # a pattern whose width passes this is searched from the start of the text
_REPEATS = {sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, getattr(sre_parse, "POSSESSIVE_REPEAT", None)} - {None}


def max_width(pattern: str) -> int | None:
    """The most characters `pattern` can match; None for unbounded (or too wide to matter)."""
    hi = sre_parse.parse(pattern).getwidth()[1]
    return hi if hi < UNBOUNDED else None


def nested_repeat(pattern: str) -> bool:
    """Whether pattern repeats, without bound, something that itself repeats a variable number of times."""
    return _nested(sre_parse.parse(pattern), False)


def _nested(parsed: object, in_unbounded: bool) -> bool:
    for op, av in parsed:  # type: ignore[attr-defined]
        if op in _REPEATS:
            low, high, body = av
            if in_unbounded and high > low:
                return True
            if _nested(body, in_unbounded or high >= UNBOUNDED):
                return True
        elif op is sre_parse.BRANCH:
            if any(_nested(branch, in_unbounded) for branch in av[1]):
                return True
        elif op is sre_parse.SUBPATTERN:
            if _nested(av[-1], in_unbounded):
                return True
        elif op in (sre_parse.ASSERT, sre_parse.ASSERT_NOT):
            if _nested(av[1], in_unbounded):
                return True
        elif op is getattr(sre_parse, "ATOMIC_GROUP", None) and _nested(av, in_unbounded):
            return True
    return False


class StopRegexScan:
    def __init__(self, patterns: list[str]) -> None:
        self.patterns = [(p, re.compile(p), max_width(p)) for p in patterns]
        self.text = ""

    def feed(self, new_text: str) -> str | None:
        """The first pattern (in the request's order) that matches text ending in new_text, or None."""
        if not new_text:
            return None
        old = len(self.text)
        self.text += new_text
        for source, compiled, width in self.patterns:
            # search(text, pos): ^ and lookbehinds still see the real start, unlike a slice
            start = 0 if width is None else max(0, old - width)
            if compiled.search(self.text, start) is not None:
                return source
        return None

"""RequestError: the one exception that means "the client's request is wrong".

Every front door (HTTP, Engine) raises it for bad input, naming the field; the
HTTP server answers it with a 400 and everything else with a 500 and a logged
traceback, so an internal bug never blames the client. It subclasses
ValueError, so Engine callers that catch ValueError keep working.
"""

from __future__ import annotations

import re

import msgspec


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.message, self.param, self.status = message, param, status


def from_validation(e: msgspec.ValidationError | msgspec.DecodeError, prefix: str = "", what: str = "JSON body") -> RequestError:
    """A msgspec error as a RequestError that names the field first.

    msgspec says e.g. "Expected `int`, got `bool` - at `$.input_ids[0]`"; this
    becomes "input_ids[0]: expected `int`, got `bool`" with param "input_ids".
    """
    msg = str(e)
    if " - at `$" in msg:
        text, path = msg.rsplit(" - at `$", 1)
        path = prefix + path.rstrip("`").lstrip(".")
        return RequestError(f"{path}: {text[0].lower()}{text[1:]}", param=re.sub(r"\[\d+\]", "", path) or None)
    if msg.startswith("Object contains unknown field `"):
        name = prefix + msg.split("`")[1]
        return RequestError(f"unknown field {name!r}", param=name)
    if isinstance(e, msgspec.DecodeError):
        return RequestError(f"malformed {what}: {msg}")
    return RequestError(f"{prefix.rstrip('.') + ': ' if prefix else ''}{msg}", param=prefix.rstrip(".") or None)

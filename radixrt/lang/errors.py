"""The DSL's exceptions."""

from __future__ import annotations


class RuntimeEndpointError(RuntimeError):
    """The server refused or failed a request; `message` is the server's own words.

    `status` is the HTTP status (None when the server could not be reached at all).
    """

    def __init__(self, message: str, status: int | None = None, url: str | None = None) -> None:
        where = f" ({url})" if url else ""
        code = f"HTTP {status}: " if status is not None else ""
        super().__init__(f"{code}{message}{where}")
        self.message, self.status, self.url = message, status, url


class ProgramError(RuntimeError):
    """A program used the DSL wrongly (nested roles, unknown variable, state already finished...)."""

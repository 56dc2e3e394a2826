"""Backends: where a program's gen/select calls go, and the process-wide default one."""

from __future__ import annotations

import threading
from typing import Any

from ..errors import ProgramError
from .base import Backend, GenOutput, SelectOutput
from .runtime import Runtime
from .runtime_endpoint import RuntimeEndpoint


class _DefaultBackend:
    """NOTE: the one piece of process-wide state in the DSL, because SGLang's API has it
    (`set_default_backend`); run(backend=...) always wins over it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._backend: Backend | None = None

    def set(self, backend: Any) -> None:
        with self._lock:
            self._backend = as_backend(backend)

    def get(self) -> Backend | None:
        with self._lock:
            return self._backend


DEFAULT_BACKEND = _DefaultBackend()


def set_default_backend(backend: Any) -> None:
    """Programs run without `backend=` use this one (a RuntimeEndpoint, or a Runtime)."""
    DEFAULT_BACKEND.set(backend)


def as_backend(backend: Any) -> Backend:
    """A Backend from a backend, or from a Runtime (its endpoint)."""
    if isinstance(backend, Runtime):
        return backend.endpoint
    if not hasattr(backend, "generate") or not hasattr(backend, "chat_template"):
        raise TypeError(f"not a backend: {backend!r} (use rt.RuntimeEndpoint(url) or rt.Runtime(...))")
    return backend


def resolve_backend(backend: Any | None) -> Backend:
    if backend is not None:
        return as_backend(backend)
    default = DEFAULT_BACKEND.get()
    if default is None:
        raise ProgramError("no backend: pass backend=... or call rt.set_default_backend(rt.RuntimeEndpoint(url))")
    return default


__all__ = ["Backend", "GenOutput", "SelectOutput", "Runtime", "RuntimeEndpoint", "set_default_backend",
           "as_backend", "resolve_backend"]

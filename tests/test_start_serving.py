"""start_serving: the frontend's tokenizer loads while node 0's processes start, and a tokenizer
that fails to load stops them (the processes are faked: this is the ordering, not the processes)."""

from __future__ import annotations

import threading

import pytest

from radixrt.config import ServerArgs
from radixrt.frontend import tokenizer_manager
from radixrt.launch import backend

ARGS = ServerArgs(model_path="unused")


def fake_backend(monkeypatch, events: list[str], during_start=lambda: None) -> None:
    class FakeBackend:
        def __init__(self, args: ServerArgs) -> None:
            events.append("processes started")
            during_start()

        def shutdown(self, timeout: float) -> None:
            events.append("processes stopped")

    monkeypatch.setattr(backend, "Backend", FakeBackend)


def test_the_tokenizer_loads_while_the_processes_start(monkeypatch):
    loaded, events = threading.Event(), []

    def load(args: ServerArgs) -> str:
        loaded.set()
        return "tokenizer"

    # the processes' start returns only once the tokenizer loaded: one after the other would wait forever
    fake_backend(monkeypatch, events, lambda: events.append("tokenizer loaded meanwhile" if loaded.wait(30) else "no"))
    monkeypatch.setattr(tokenizer_manager, "load_tokenizer", load)
    started, tokenizer = backend.start_serving(ARGS)
    assert tokenizer == "tokenizer" and events == ["processes started", "tokenizer loaded meanwhile"]
    assert isinstance(started, backend.Backend)


def test_a_tokenizer_that_fails_to_load_stops_the_processes(monkeypatch):
    events: list[str] = []

    def broken(args: ServerArgs) -> None:
        raise OSError("tokenizer.json is damaged")

    fake_backend(monkeypatch, events)
    monkeypatch.setattr(tokenizer_manager, "load_tokenizer", broken)
    with pytest.raises(OSError, match="damaged"):
        backend.start_serving(ARGS)
    assert events == ["processes started", "processes stopped"]

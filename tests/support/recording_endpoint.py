"""A RuntimeEndpoint whose HTTP calls never leave the process, for the DSL's unit tests: it keeps
each request body it sends and answers every /generate with the text "7" (`answer` may say
otherwise). Thread-safe, for run_batch and forks."""

from __future__ import annotations

import threading
from typing import Any

import radixrt as rt

ANSWER_7 = {"text": "7", "meta_info": {"prompt_tokens": 1, "cached_tokens": 0, "completion_tokens": 1}}


class RecordingEndpoint(rt.RuntimeEndpoint):
    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        super().__init__("http://recording.invalid")

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        if path == "/get_model_info":
            return {"model_path": "recording"}
        with self._lock:
            self.bodies.append(body)
        return self.answer(body)

    def answer(self, body: dict[str, Any]) -> Any:
        return ANSWER_7

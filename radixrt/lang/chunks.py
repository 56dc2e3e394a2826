"""ChunkLog: the text a state appends, in order, for streaming readers."""

from __future__ import annotations

import threading
from typing import Iterator


class ChunkLog:
    """Append-only list of (variable or None, text) pieces; readers block until more come or it closes.

    Every reader sees every chunk from the start, so `text_iter()` may be called at any
    time and more than once; the joined chunks always equal the state's text.
    """

    def __init__(self, initial: str = "") -> None:
        self._cond = threading.Condition()
        self._chunks: list[tuple[str | None, str]] = [(None, initial)] if initial else []
        self._closed = False

    def append(self, var: str | None, text: str) -> None:
        if text:
            with self._cond:
                self._chunks.append((var, text))
                self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def iter(self, var: str | None = None) -> Iterator[str]:
        """Chunks of the whole text (var None) or of one variable, until the log closes."""
        seen = 0
        while True:
            with self._cond:
                while len(self._chunks) <= seen and not self._closed:
                    self._cond.wait()
                batch, closed = self._chunks[seen:], self._closed
            seen += len(batch)
            for tag, text in batch:
                if var is None or tag == var:
                    yield text
            if closed and not batch:
                return

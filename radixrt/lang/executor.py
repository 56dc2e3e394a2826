"""StreamExecutor: runs one program state's expressions in order, on the state's own thread.

The program's Python body runs in the caller's thread and only *submits*
expressions (`s += ...`); this thread sends them to the backend one by one. So
Python control flow is eager, model calls are asynchronous until a value is
read (`s["x"]` blocks for it), and independent states overlap on the server.
What each expression does to the text is the Interpreter's (interpreter.py);
this module owns the thread, the waiting and the variables.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

from .backend.base import Backend
from .chunks import ChunkLog
from .errors import ProgramError
from .interpreter import Interpreter, Snapshot
from .ir import Expr, GenParams


class StreamExecutor:
    """Owns a state's variables and meta_info, and the worker thread whose Interpreter writes its
    text and messages; only that thread mutates them.

    Readers call `sync()` (or `get_var`) first: once no expression is pending, the fields are stable.
    After an error the remaining expressions are skipped and every waiting reader wakes up.
    """

    def __init__(self, backend: Backend, defaults: GenParams, stream: bool, start: Snapshot | None = None) -> None:
        start = start or Snapshot()
        self.backend, self.defaults, self.stream = backend, defaults, stream
        self.variables, self.meta = dict(start.variables), dict(start.meta)
        self.written: list[str] = []  # variables set here (not inherited), in order: what a fork join gathers
        self.error: BaseException | None = None
        self.interpreter = Interpreter(backend, defaults, stream, start, self.set_var)
        self.children: list[StreamExecutor] = []
        self._cond = threading.Condition()
        self._pending = 0
        self._ended = False
        self._queue: queue.SimpleQueue[Expr | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="radixrt-lang-executor", daemon=True)
        self._thread.start()

    # --- the interpreter's state, stable once sync() returned ---

    @property
    def text(self) -> str:
        return self.interpreter.text

    @property
    def messages(self) -> list[dict[str, str]]:
        return self.interpreter.messages

    @property
    def chunks(self) -> ChunkLog:
        return self.interpreter.chunks

    @property
    def prefix_meta(self) -> dict[str, Any] | None:
        """meta_info of the last CachePrefix request."""
        return self.interpreter.prefix_meta

    # --- called from the program's thread ---

    def submit(self, expr: Expr) -> None:
        with self._cond:
            if self._ended:
                raise ProgramError("this program has finished; run it again to continue")
            self._pending += 1
        self._queue.put(expr)

    def end(self) -> None:
        """No more expressions: the thread exits once the queued ones ran (and so do the branches')."""
        with self._cond:
            if self._ended:
                return
            self._ended = True
        self._queue.put(None)
        for child in self.children:
            child.end()

    def sync(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._pending == 0)

    def fail(self, error: BaseException) -> None:
        with self._cond:
            self.error = self.error or error
            self._cond.notify_all()

    def check(self) -> None:
        """Raise the program's error, if it failed."""
        if self.error is not None:
            raise self.error

    def get_var(self, name: str) -> Any:
        """Waits until `name` is set; KeyError if everything submitted ran without setting it."""
        with self._cond:
            self._cond.wait_for(lambda: name in self.variables or self.error is not None or self._pending == 0)
            if name in self.variables:
                return self.variables[name]
            self.check()
            raise KeyError(f"the program set no variable {name!r}")

    def set_var(self, name: str, value: Any, meta: Any = None) -> None:
        with self._cond:
            self.variables[name] = value
            if meta is not None:
                self.meta[name] = meta
            if name not in self.written:
                self.written.append(name)
            self._cond.notify_all()

    def snapshot(self) -> Snapshot:
        self.sync()
        run = self.interpreter
        return Snapshot(run.text, dict(self.variables), dict(self.meta), [dict(m) for m in run.messages],
                        run.role, run.role_start)

    def branch(self) -> StreamExecutor:
        """A new executor starting from this one's current state (for fork)."""
        child = StreamExecutor(self.backend, self.defaults, self.stream, self.snapshot())
        self.children.append(child)
        return child

    # --- the worker thread ---

    def _loop(self) -> None:
        while (expr := self._queue.get()) is not None:
            try:
                if self.error is None:
                    self.interpreter.execute(expr)
            except Exception as e:  # surfaced to the program by get_var/text()/run()
                self.fail(e)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
        self.interpreter.chunks.close()

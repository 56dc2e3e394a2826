"""StreamExecutor: runs one program state's expressions in order, on the state's own thread.

The program's Python body runs in the caller's thread and only *submits*
expressions (`s += ...`); this thread sends them to the backend one by one. So
Python control flow is eager, model calls are asynchronous until a value is
read (`s["x"]` blocks for it), and independent states overlap on the server.
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from radixrt.reasoning import ReasoningFormat, get_format, separate

from .backend.base import Backend, GenOutput
from .chunks import ChunkLog
from .errors import ProgramError
from .ir import (CachePrefix, Expr, ExprList, Gen, GenParams, Role, RoleBegin, RoleEnd, Select, SeparateReasoning, Text)


@dataclass
class Snapshot:
    """What a fork copies into each branch."""

    text: str = ""
    variables: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    role: str | None = None
    role_start: int = 0  # where the open role's content begins in text


class StreamExecutor:
    """Owns a state's text, variables, meta_info and messages; one worker thread mutates them.

    Readers call `sync()` (or `get_var`) first: once no expression is pending, the fields are stable.
    After an error the remaining expressions are skipped and every waiting reader wakes up.
    """

    def __init__(self, backend: Backend, defaults: GenParams, stream: bool, start: Snapshot | None = None) -> None:
        start = start or Snapshot()
        self.backend, self.defaults, self.stream = backend, defaults, stream
        self.template = backend.chat_template
        self.text = start.text
        self.variables, self.meta = dict(start.variables), dict(start.meta)
        self.messages = [dict(m) for m in start.messages]
        self.role, self.role_start = start.role, start.role_start
        self.written: list[str] = []  # variables set here (not inherited), in order: what a fork join gathers
        self.prefix_meta: dict[str, Any] | None = None  # meta_info of the last CachePrefix request
        self.separating: ReasoningFormat | None = None  # inside separate_reasoning: how outputs split
        self.error: BaseException | None = None
        self.chunks = ChunkLog(start.text)
        self.children: list[StreamExecutor] = []
        self._cond = threading.Condition()
        self._pending = 0
        self._ended = False
        self._queue: queue.SimpleQueue[Expr | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="radixrt-lang-executor", daemon=True)
        self._thread.start()

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

    def get_var(self, name: str) -> Any:
        """Waits until `name` is set; KeyError if everything submitted ran without setting it."""
        with self._cond:
            self._cond.wait_for(lambda: name in self.variables or self.error is not None or self._pending == 0)
            if name in self.variables:
                return self.variables[name]
            if self.error is not None:
                raise self.error
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
        return Snapshot(self.text, dict(self.variables), dict(self.meta), [dict(m) for m in self.messages],
                        self.role, self.role_start)

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
                    self._execute(expr)
            except Exception as e:  # surfaced to the program by get_var/text()/run()
                self.fail(e)
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()
        self.chunks.close()

    def _execute(self, expr: Expr) -> None:
        handler = _HANDLERS.get(type(expr))
        if handler is None:
            raise ProgramError(f"cannot execute {type(expr).__name__}")
        handler(self, expr)

    def _append(self, var: str | None, text: str) -> None:
        self.text += text
        self.chunks.append(var, text)

    def _text(self, expr: Text) -> None:
        self._append(None, expr.value)

    def _list(self, expr: ExprList) -> None:
        for item in expr.items:
            self._execute(item)

    def _role(self, expr: Role) -> None:
        self._role_begin(RoleBegin(expr.role))
        self._execute(expr.content)
        self._role_end(RoleEnd(expr.role))

    def _role_begin(self, expr: RoleBegin) -> None:
        if self.role is not None:
            raise ProgramError(f"{expr.role} role inside the {self.role} role: roles do not nest")
        default_system = self.template.default_system_prompt
        if default_system and not self.messages and expr.role != "system":  # SGLang's rule: it goes first
            self._role(Role("system", Text(default_system)))
        self._append(None, self.template.prefix(expr.role, self.messages))
        self.role, self.role_start = expr.role, len(self.text)

    def _role_end(self, expr: RoleEnd) -> None:
        if self.role != expr.role:
            raise ProgramError(f"ending the {expr.role} role, but the open role is {self.role}")
        content = self.text[self.role_start:].lstrip()  # SGLang's message drops leading whitespace; the text keeps it
        self._append(None, self.template.suffix(expr.role, self.messages))  # it sees the turns before this one
        self.messages.append({"role": expr.role, "content": content})
        self.role = None

    def _gen(self, expr: Gen) -> None:
        # SGLang adds the template's end-of-turn strings to every gen, in a role or not, after the gen's own.
        params = expr.params.over(self.defaults).with_stop(self.template.stop_str)
        if self.stream:
            out = self._gen_streamed(expr.name, params)
            self._set(expr.name, out.text, out.meta)
        else:
            out = self.backend.generate(self.text, params)
            self._output(expr.name, out.text, out.meta)

    def _gen_streamed(self, name: str | None, params: GenParams) -> GenOutput:
        """Append each new piece as it comes. The server's snapshots are cumulative and only grow
        (it holds back a tail that could still become a stop string)."""
        shown, meta = "", {}
        for out in self.backend.generate_stream(self.text, params):
            if out.text.startswith(shown):
                self._append(name, out.text[len(shown):])
                shown = out.text
            meta = out.meta
        return GenOutput(shown, meta)

    def _select(self, expr: Select) -> None:
        lora_path = expr.lora_path or self.defaults.lora_path
        out = self.backend.select(self.text, expr.choices, expr.method, lora_path=lora_path)
        self._output(expr.name, out.choice, out.meta)

    def _separate_reasoning(self, expr: SeparateReasoning) -> None:
        # A stream has shown the text as it came: SGLang leaves it (and the variables) whole there.
        outer, self.separating = self.separating, None if self.stream else get_format(expr.model_type)
        try:
            self._execute(expr.expr)
        finally:
            self.separating = outer

    def _output(self, name: str | None, text: str, meta: Any) -> None:
        """A gen's or select's whole output: appended, and stored in `name` (only its content, and its
        reasoning beside it, under separate_reasoning)."""
        if self.separating is not None and name is not None:
            parts = separate(text, self.separating)
            text = parts.content
            self.set_var(f"{name}_reasoning_content", parts.reasoning)
        self._append(name, text)
        self._set(name, text, meta)

    def _cache_prefix(self, expr: CachePrefix) -> None:
        # With the program's adapter: the server caches per adapter, so that is what the branches will find.
        lora_path = self.defaults.lora_path
        self.prefix_meta = self.backend.cache_prefix(self.text, lora_path=lora_path) if self.text else None

    def _set(self, name: str | None, value: Any, meta: Any) -> None:
        if name is not None:
            self.set_var(name, value, meta)


_HANDLERS: dict[type, Callable[[StreamExecutor, Any], None]] = {
    Text: StreamExecutor._text,
    ExprList: StreamExecutor._list,
    Role: StreamExecutor._role,
    RoleBegin: StreamExecutor._role_begin,
    RoleEnd: StreamExecutor._role_end,
    Gen: StreamExecutor._gen,
    Select: StreamExecutor._select,
    CachePrefix: StreamExecutor._cache_prefix,
    SeparateReasoning: StreamExecutor._separate_reasoning,
}

"""Interpreter: what each expression does to a program state's text, chat turns and variables.

It runs on the state's executor thread (executor.py), one expression at a time: text is appended
(and logged for streaming readers), a role writes the chat template around its turn and records
the message, gen and select call the backend and store their output through the executor's
set_var (where readers wait for variables), cache_prefix sends the text so far to be cached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from radixrt.reasoning import ReasoningFormat, get_format, separate

from .backend.base import Backend, GenOutput
from .chunks import ChunkLog
from .errors import ProgramError
from .ir import CachePrefix, Expr, ExprList, Gen, GenParams, Role, RoleBegin, RoleEnd, Select, SeparateReasoning, Text

SetVar = Callable[[str, Any, Any], None]  # (name, value, meta or None): the executor's set_var


@dataclass
class Snapshot:
    """What a fork copies into each branch."""

    text: str = ""
    variables: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    role: str | None = None
    role_start: int = 0  # where the open role's content begins in text


class Interpreter:
    """Owns a state's text, chunk log, messages and open role; only the executor's thread calls it."""

    def __init__(self, backend: Backend, defaults: GenParams, stream: bool, start: Snapshot, set_var: SetVar) -> None:
        self.backend, self.defaults, self.stream = backend, defaults, stream
        self.template = backend.chat_template
        self.text = start.text
        self.messages = [dict(m) for m in start.messages]
        self.role, self.role_start = start.role, start.role_start
        self.prefix_meta: dict[str, Any] | None = None  # meta_info of the last CachePrefix request
        self.separating: ReasoningFormat | None = None  # inside separate_reasoning: how outputs split
        self.chunks = ChunkLog(start.text)
        self._set_var = set_var

    def execute(self, expr: Expr) -> None:
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
            self.execute(item)

    def _role(self, expr: Role) -> None:
        self._role_begin(RoleBegin(expr.role))
        self.execute(expr.content)
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
            self.execute(expr.expr)
        finally:
            self.separating = outer

    def _output(self, name: str | None, text: str, meta: Any) -> None:
        """A gen's or select's whole output: appended, and stored in `name` (only its content, and its
        reasoning beside it, under separate_reasoning)."""
        if self.separating is not None and name is not None:
            parts = separate(text, self.separating)
            text = parts.content
            self._set_var(f"{name}_reasoning_content", parts.reasoning, None)
        self._append(name, text)
        self._set(name, text, meta)

    def _cache_prefix(self, expr: CachePrefix) -> None:
        # With the program's adapter: the server caches per adapter, so that is what the branches will find.
        lora_path = self.defaults.lora_path
        self.prefix_meta = self.backend.cache_prefix(self.text, lora_path=lora_path) if self.text else None

    def _set(self, name: str | None, value: Any, meta: Any) -> None:
        if name is not None:
            self._set_var(name, value, meta)


_HANDLERS: dict[type, Callable[[Interpreter, Any], None]] = {
    Text: Interpreter._text,
    ExprList: Interpreter._list,
    Role: Interpreter._role,
    RoleBegin: Interpreter._role_begin,
    RoleEnd: Interpreter._role_end,
    Gen: Interpreter._gen,
    Select: Interpreter._select,
    CachePrefix: Interpreter._cache_prefix,
    SeparateReasoning: Interpreter._separate_reasoning,
}

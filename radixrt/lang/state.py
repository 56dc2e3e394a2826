"""ProgramState: the `s` a program writes to and reads from; ProgramStateGroup: the
branches of `s.fork(n)`, and joining them back."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any, AsyncIterator, Callable, Iterator

from .executor import StreamExecutor
from .ir import CachePrefix, RoleBegin, RoleEnd, Role, to_expr


class ProgramState:
    """A program's text and variables. Appending (`s += ...`) never blocks; reading
    (`s["x"]`, `s.text()`, `s.messages()`) waits for the work it depends on and
    raises the program's error, if it failed."""

    def __init__(self, executor: StreamExecutor) -> None:
        self._executor = executor

    # --- writing ---

    def __iadd__(self, other: Any) -> ProgramState:
        self._executor.submit(to_expr(other))
        return self

    def set_var(self, name: str, value: Any) -> None:
        self._executor.set_var(name, value)

    __setitem__ = set_var

    def system(self, content: Any = None) -> contextlib.AbstractContextManager[None] | None:
        """`s.system("...")` appends a system turn; `with s.system(): ...` wraps what the block appends."""
        return self._role("system", content)

    def user(self, content: Any = None) -> contextlib.AbstractContextManager[None] | None:
        return self._role("user", content)

    def assistant(self, content: Any = None) -> contextlib.AbstractContextManager[None] | None:
        return self._role("assistant", content)

    def _role(self, role: str, content: Any) -> contextlib.AbstractContextManager[None] | None:
        if content is not None:
            self._executor.submit(Role(role, to_expr(content)))
            return None
        return self._role_scope(role)

    @contextlib.contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self._executor.submit(RoleBegin(role))
        yield
        self._executor.submit(RoleEnd(role))

    def fork(self, n: int = 1) -> ProgramStateGroup:
        """n branches that start from this state's text and variables and run concurrently.

        With n > 1 the text so far is first sent once as a prefill-only request, so the
        branches find it in the radix cache instead of all computing it at once.
        """
        if n > 1:
            self._executor.submit(CachePrefix())
        self.sync()
        self._executor.check()
        base = self._executor.snapshot()
        branches = [ProgramState(self._executor.branch()) for _ in range(n)]
        return ProgramStateGroup(self, branches, base.text, self._executor.prefix_meta if n > 1 else None)

    # --- reading ---

    def __getitem__(self, name: str) -> Any:
        return self._executor.get_var(name)

    get_var = __getitem__

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._executor.variables

    def get_meta_info(self, name: str) -> Any:
        """The server's meta_info of the gen/select that set `name` (a list of them after a fork join)."""
        self._executor.get_var(name)
        return self._executor.meta.get(name)

    def text(self) -> str:
        self.sync()
        self._executor.check()
        return self._executor.text

    def messages(self) -> list[dict[str, str]]:
        """The finished role turns as [{"role": ..., "content": ...}] (OpenAI's layout)."""
        self.sync()
        self._executor.check()
        return [dict(m) for m in self._executor.messages]

    def sync(self) -> None:
        """Wait until everything submitted so far has run."""
        self._executor.sync()

    def error(self) -> BaseException | None:
        return self._executor.error

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """The text as it is produced (of the whole program, or of one variable), until the program ends."""
        yield from self._executor.chunks.iter(var_name)
        self._executor.check()

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """text_iter for asyncio: each wait happens in a worker thread, never on the event loop."""
        chunks, done = self.text_iter(var_name), object()
        while (chunk := await asyncio.to_thread(next, chunks, done)) is not done:
            yield chunk

    @property
    def executor(self) -> StreamExecutor:
        return self._executor

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """n branch states. `forks += expr` appends to every branch (`lambda i: ...` or a list:
    one each); `forks[i]` is a branch; `join()` brings the branches' results to the parent."""

    def __init__(self, parent: ProgramState, branches: list[ProgramState], base_text: str,
                 prefix_meta: dict[str, Any] | None) -> None:
        self.parent, self.branches, self.base_text = parent, branches, base_text
        # meta_info of the prefill-only request that cached the shared prefix (None if none was sent)
        self.prefix_meta = prefix_meta

    def __len__(self) -> int:
        return len(self.branches)

    def __getitem__(self, i: int) -> ProgramState:
        return self.branches[i]

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.branches)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if isinstance(other, list):
            if len(other) != len(self.branches):
                raise ValueError(f"{len(other)} expressions for {len(self.branches)} branches")
            parts: Callable[[int], Any] = other.__getitem__
        elif callable(other):
            parts = other
        else:
            parts = lambda i: other  # noqa: E731
        for i, branch in enumerate(self.branches):
            branch += parts(i)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch, then bring back their results and end their threads.

        "gather_variable": each variable a branch set becomes, on the parent, the list of every
        branch's value (None where a branch did not set it); its meta_info likewise.
        "concate_and_append": the parent's text gets each branch's new text, in branch order.
        Raises the first branch error.
        """
        for branch in self.branches:
            branch.sync()
            if branch.error() is not None:
                raise branch.error()
        executors = [b.executor for b in self.branches]
        if mode == "gather_variable":
            names = list(dict.fromkeys(name for ex in executors for name in ex.written))
            for name in names:
                values = [ex.variables.get(name) for ex in executors]
                self.parent.executor.set_var(name, values, [ex.meta.get(name) for ex in executors])
        elif mode == "concate_and_append":
            self.parent += "".join(ex.text[len(self.base_text):] for ex in executors)
        else:
            raise ValueError(f"unknown join mode {mode!r} (gather_variable | concate_and_append)")
        for ex in executors:
            ex.end()

"""ProgramStateGroup: the branches of `s.fork(n)`, and joining them back."""

from __future__ import annotations

from typing import Any, Callable, Iterator

from .state import ProgramState


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

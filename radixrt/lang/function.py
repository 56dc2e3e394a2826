"""@function: a program, and how it runs (one state, or a batch of them)."""

from __future__ import annotations

import functools
import inspect
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from .backend import resolve_backend
from .errors import RuntimeEndpointError
from .executor import StreamExecutor
from .ir import DEFAULT_PARAMS, GenParams
from .state import ProgramState


def split_sampling(kwargs: dict[str, Any]) -> tuple[GenParams, dict[str, Any]]:
    """run()'s keyword arguments: defaults for every gen (GenParams' names, lora_path too), and the program's own."""
    names = GenParams.field_names()
    sampling = {k: v for k, v in kwargs.items() if k in names}
    rest = {k: v for k, v in kwargs.items() if k not in names}
    return GenParams.build(**sampling).over(DEFAULT_PARAMS), rest


def auto_threads(batch_size: int) -> int:
    # The threads mostly wait on HTTP; the server batches whatever arrives, so be generous.
    return max(1, min(batch_size, max(64, 16 * (os.cpu_count() or 1))))


class Function:
    """A DSL program: a Python function whose first parameter is the state `s`."""

    def __init__(self, func: Callable[..., Any], bound: dict[str, Any] | None = None) -> None:
        params = list(inspect.signature(func).parameters)
        if not params or params[0] != "s":
            raise TypeError(f"the first parameter of a program must be named 's' ({func.__name__} has {params[:1]})")
        self.func, self.bound = func, dict(bound or {})
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> Function:
        """The same program with some arguments fixed."""
        return Function(self.func, {**self.bound, **kwargs})

    def run(self, *args: Any, stream: bool = False, backend: Any = None, **kwargs: Any) -> ProgramState:
        """Run once. Keyword arguments named like gen's settings (max_new_tokens, temperature, stop,
        top_p, ...) are defaults for every gen; the others go to the program. `lora_path` (an adapter's
        name) is the default adapter of every gen and select, in forks too; theirs overrides it.

        Without stream, returns when the program is done and raises its error. With stream=True,
        returns once the body has run (gen calls may still be going): read with s.text_iter().
        """
        defaults, kwargs = split_sampling(kwargs)
        state = self._start(args, kwargs, defaults, resolve_backend(backend), stream)
        if not stream:
            state.sync()
        if state.error() is not None:
            raise state.error()
        return state

    __call__ = run

    def run_batch(self, batch: Sequence[dict[str, Any] | Sequence[Any]], *, num_threads: int | str = "auto",
                  progress_bar: bool = False, backend: Any = None, **sampling: Any) -> list[ProgramState]:
        """Run once per item (a dict of keyword arguments, or a tuple of positional ones), concurrently;
        the states come back in input order. `sampling` holds run()'s defaults for every item (lora_path too).

        A server error stays in its state (`s.error()`; reading the state raises it) so one bad item
        does not hide the others' results; any other exception (a bug in the program) is raised.
        """
        defaults, rest = split_sampling(sampling)
        if rest:
            raise TypeError(f"run_batch got unknown keyword arguments {sorted(rest)}")
        chosen = resolve_backend(backend)
        threads = auto_threads(len(batch)) if num_threads == "auto" else int(num_threads)

        def one(item: dict[str, Any] | Sequence[Any]) -> ProgramState:
            args, kwargs = ((), dict(item)) if isinstance(item, dict) else (tuple(item), {})
            state = self._start(args, kwargs, defaults, chosen, stream=False)
            state.sync()
            return state

        with ThreadPoolExecutor(max_workers=max(threads, 1)) as pool:
            futures = [pool.submit(one, item) for item in batch]
            states = [f.result() for f in _progress(futures, progress_bar)]
        for state in states:
            error = state.error()
            if error is not None and not isinstance(error, RuntimeEndpointError):
                raise error
        return states

    def _start(self, args: tuple[Any, ...], kwargs: dict[str, Any], defaults: GenParams, backend: Any,
               stream: bool) -> ProgramState:
        """Run the body in this thread (it only submits work); the state's thread does the calls."""
        executor = StreamExecutor(backend, defaults, stream)
        state = ProgramState(executor)
        try:
            self.func(state, *args, **{**self.bound, **kwargs})
        except Exception as e:
            executor.fail(e)
        finally:
            executor.end()
        return state


def _progress(futures: list[Any], enabled: bool) -> list[Any]:
    """The futures in input order, waited with a tqdm bar when asked."""
    if not enabled:
        return futures
    from concurrent.futures import as_completed

    from tqdm import tqdm

    for _ in tqdm(as_completed(futures), total=len(futures)):
        pass
    return futures


def function(func: Callable[..., Any]) -> Function:
    """Decorator: turn `def prog(s, ...)` into a program with .run() and .run_batch()."""
    return Function(func)

"""radixrt: an LLM serving runtime with a global radix prefix cache.

`import radixrt` stays light (no torch): the Engine is imported on first use,
so a machine that only runs DSL clients never loads the runtime.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Engine", "ServerArgs"]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixrt.engine import Engine

        return Engine
    if name == "ServerArgs":
        from radixrt.config import ServerArgs

        return ServerArgs
    raise AttributeError(f"module 'radixrt' has no attribute {name!r}")

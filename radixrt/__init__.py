"""radixrt: an LLM serving runtime with a global radix prefix cache.

`import radixrt` stays light (no torch): the Engine and the DSL are imported on
first use, so a machine that only runs DSL clients never loads the runtime.
"""

from __future__ import annotations

from typing import Any

# The frontend DSL (package radixrt.lang): re-exported here so programs
# read `import radixrt as rt; rt.gen(...)`.
LANG_EXPORTS = (
    "function", "gen", "select", "separate_reasoning", "system", "user", "assistant",
    "RuntimeEndpoint", "Runtime", "set_default_backend", "RuntimeEndpointError",
    "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized",
)

__all__ = ["Engine", "ServerArgs", *LANG_EXPORTS]


def __getattr__(name: str) -> Any:
    if name == "Engine":
        from radixrt.engine import Engine

        return Engine
    if name == "ServerArgs":
        from radixrt.config import ServerArgs

        return ServerArgs
    if name in LANG_EXPORTS:
        # The one place the runtime package refers to the DSL: this facade, lazily
        # (tests/test_layering.py allows exactly this file).
        import radixrt.lang

        return getattr(radixrt.lang, name)
    raise AttributeError(f"module 'radixrt' has no attribute {name!r}")

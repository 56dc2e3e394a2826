"""How deep the free-form JSON of a chat request may nest before it reaches the chat template.

The template (transformers' preparation of tools, then Jinja) walks tools, tool calls and template
variables recursively: a few hundred levels exhaust Python's recursion limit, which was a 500.
Real tool schemas and template variables nest a few levels; deeper than MAX_TEMPLATE_DEPTH is a
400 naming the field and the limit, checked before the template runs. The check itself walks
without recursion, so any depth the body decoder lets through is measured.
"""

from __future__ import annotations

from typing import Any

from radixrt.errors import RequestError
from radixrt.server.schemas import ChatCompletionRequest

MAX_TEMPLATE_DEPTH = 64  # nested arrays and objects; a JSON Schema object level is two (properties, then it)


def nesting_depth(value: Any) -> int:
    """Levels of nested lists and dicts in value (a scalar: 0, [] or {}: 1, [[1]]: 2)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, depth)
        stack.extend((item, depth + 1) for item in v)
    return deepest


def check_depth(value: Any, field: str, param: str, limit: int = MAX_TEMPLATE_DEPTH) -> None:
    """RequestError (param) naming field and the limit when value nests deeper than limit."""
    depth = nesting_depth(value)
    if depth > limit:
        raise RequestError(f"{field} is nested {depth} levels deep; the limit is {limit}", param)


def check_template_depths(body: ChatCompletionRequest) -> None:
    """Every free-form value of a chat request that the chat template walks, within MAX_TEMPLATE_DEPTH."""
    check_depth(body.tools, "tools", "tools")
    check_depth(body.tool_choice, "tool_choice", "tool_choice")
    check_depth(body.chat_template_kwargs, "chat_template_kwargs", "chat_template_kwargs")
    for i, m in enumerate(body.messages):
        check_depth(m.tool_calls, f"messages[{i}].tool_calls", "messages")

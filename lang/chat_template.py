"""Role prefixes and suffixes, chosen by model path (the DSL never loads a tokenizer).

Like SGLang's frontend, the client renders roles itself from a small table and
picks the entry by matching the server's `model_path`; ChatML is the default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    roles: dict[str, tuple[str, str]]  # role -> (prefix, suffix)
    stop_str: tuple[str, ...] = ()  # ends an assistant turn: added to gen's stop inside assistant()

    def prefix(self, role: str) -> str:
        return self._pair(role)[0]

    def suffix(self, role: str) -> str:
        return self._pair(role)[1]

    def _pair(self, role: str) -> tuple[str, str]:
        if role not in self.roles:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}")
        return self.roles[role]


def _chatml_role(role: str) -> tuple[str, str]:
    return f"<|im_start|>{role}\n", "<|im_end|>\n"


CHATML = ChatTemplate("chatml", {r: _chatml_role(r) for r in ("system", "user", "assistant")}, ("<|im_end|>",))

LLAMA3_INSTRUCT = ChatTemplate(
    "llama-3-instruct",
    {r: (f"<|start_header_id|>{r}<|end_header_id|>\n\n", "<|eot_id|>") for r in ("system", "user", "assistant")},
    ("<|eot_id|>",),
)

TEMPLATES: dict[str, ChatTemplate] = {t.name: t for t in (CHATML, LLAMA3_INSTRUCT)}

# (test on the lower-cased model path, template name); the first match wins.
MATCHERS: list[tuple[Callable[[str], bool], str]] = [
    (lambda p: ("llama-3" in p or "llama3" in p) and "instruct" in p, "llama-3-instruct"),
]


def get_chat_template(name: str) -> ChatTemplate:
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}")
    return TEMPLATES[name]


def chat_template_for(model_path: str) -> ChatTemplate:
    path = model_path.lower()
    for matches, name in MATCHERS:
        if matches(path):
            return TEMPLATES[name]
    return CHATML

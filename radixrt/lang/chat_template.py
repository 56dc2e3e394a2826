"""ChatTemplate: how a role turn is written into a program's text (the DSL never loads a tokenizer).

Like SGLang's frontend, the client renders roles itself from a small table
(chat_template_registry.py, chosen by the server's `model_path`). A template is
text only: role prefix and suffix, the string that ends a turn (added to every
gen's stop), and a system prompt put first when a program opens with another role.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

Message = Mapping[str, str]  # {"role": ..., "content": ...}, a finished turn


@dataclass(frozen=True)
class ChatTemplate:
    name: str
    roles: Mapping[str, tuple[str, str]]  # role -> (prefix, suffix)
    stop_str: tuple[str, ...] = ()  # ends a turn: added to every gen's stop (SGLang's rule)
    default_system_prompt: str | None = None  # written as a system turn when the first turn is not one

    def prefix(self, role: str, history: Sequence[Message] = ()) -> str:
        """The text that opens a `role` turn after the finished turns `history`."""
        return self._pair(role)[0]

    def suffix(self, role: str, history: Sequence[Message] = ()) -> str:
        """The text that closes a `role` turn; `history` is the turns finished before this one."""
        return self._pair(role)[1]

    def _pair(self, role: str) -> tuple[str, str]:
        if role not in self.roles:
            raise ValueError(f"chat template {self.name!r} has no role {role!r}")
        return self.roles[role]


@dataclass(frozen=True)
class Llama2ChatTemplate(ChatTemplate):
    """Llama 2 chat writes the system prompt inside the first user instruction:
    `[INST] <<SYS>>\\n{system}\\n<</SYS>>\\n\\n{user} [/INST]`. So an opening system turn
    starts with the user prefix, and the user turn right after it has no prefix of its own."""

    def prefix(self, role: str, history: Sequence[Message] = ()) -> str:
        if role == "system" and not history:
            return self._pair("user")[0] + self._pair("system")[0]
        if role == "user" and _after_system(history):
            return ""
        return self._pair(role)[0]


def _after_system(history: Sequence[Message]) -> bool:
    # NOTE: SGLang tests only len(history) == 1; we also require that turn to be the system
    # one (the case the rule is for), so a lone earlier user or assistant turn keeps "[INST] ".
    return len(history) == 1 and history[0]["role"] == "system"

"""What an executor needs from a backend, and what the backend gives back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol, Sequence

from ..chat_template import ChatTemplate
from ..choices import ChoicesMethod
from ..ir import GenParams


@dataclass(frozen=True)
class GenOutput:
    text: str
    meta: dict[str, Any] = field(default_factory=dict)  # the server's meta_info


@dataclass(frozen=True)
class SelectOutput:
    index: int  # into the choices
    choice: str
    meta: dict[str, Any]  # normalized_prompt_logprobs, input_token_logprobs, ... (choices.py)


class Backend(Protocol):
    """A model to run programs on. Every call blocks; raises RuntimeEndpointError on a server error.

    `lora_path` (in GenParams for generate) names the LoRA adapter every request of the call runs
    on; None means the base model.

    Calls come from many executor threads at once, so an implementation must be thread-safe.
    """

    chat_template: ChatTemplate

    def generate(self, prompt: str, params: GenParams) -> GenOutput: ...

    def generate_stream(self, prompt: str, params: GenParams) -> Iterator[GenOutput]:
        """Snapshots of the output so far (text is cumulative); the last one is final."""
        ...

    def cache_prefix(self, prompt: str, lora_path: str | None = None) -> dict[str, Any]:
        """Prefill `prompt` only (no tokens generated) so later requests find it cached; its meta_info."""
        ...

    def select(self, prompt: str, choices: Sequence[str], method: ChoicesMethod,
               lora_path: str | None = None) -> SelectOutput:
        """Score every choice after `prompt` and let `method` pick one."""
        ...

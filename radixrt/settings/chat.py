"""The OpenAI chat route's text handling: the chat template, tool-call and reasoning parsers, and
where a chat completion's unset sampling parameters come from."""

from __future__ import annotations

import os
from dataclasses import dataclass

from radixrt.reasoning import REASONING_PARSERS
from radixrt.settings.fields import arg

TOOL_CALL_PARSERS = (  # radixrt/server/tool_calls.py
    "hermes", "qwen25", "llama3", "mistral", "pythonic", "deepseekv3", "qwen3_coder", "gpt-oss",
)
CHAT_TEMPLATE_NAMES = (  # radixrt/server/chat_templates.py
    "chatml", "qwen", "qwen2-vl", "llama-2", "llama-3-instruct", "llama-4", "mistral", "gemma-it", "vicuna_v1.1",
    "internlm2-chat", "phi-4-mm",
)
SAMPLING_DEFAULTS = ("model", "openai")


@dataclass(frozen=True)
class ChatArgs:
    chat_template: str | None = arg(
        None, "the chat template used instead of the tokenizer's own: a Jinja file, or one of SGLang's template names "
        f"({', '.join(CHAT_TEMPLATE_NAMES)})"
    )
    tool_call_parser: str | None = arg(
        None, "how /v1/chat/completions finds tool calls in the model's text: hermes, qwen25, llama3, mistral, "
        "pythonic, deepseekv3, qwen3_coder or gpt-oss"
    )
    reasoning_parser: str | None = arg(
        None, "how /v1/chat/completions separates the model's reasoning from its answer (message.reasoning_content), "
        f"by SGLang's format names: {', '.join(REASONING_PARSERS)}"
    )
    sampling_defaults: str = arg(
        "model", "where a chat completion's unset temperature, top_p, top_k, min_p and repetition_penalty come from: "
        "model (the checkpoint's generation_config.json) or openai (1.0, 1.0, -1, 0.0, 1.0), as in SGLang"
    )

    def check(self) -> None:
        if self.chat_template is not None and not (
            self.chat_template in CHAT_TEMPLATE_NAMES or os.path.isfile(self.chat_template)
        ):
            raise ValueError(f"chat_template {self.chat_template!r} is neither a file nor a template name "
                             f"({', '.join(CHAT_TEMPLATE_NAMES)})")
        if self.sampling_defaults not in SAMPLING_DEFAULTS:
            raise ValueError(f"sampling_defaults must be one of {', '.join(SAMPLING_DEFAULTS)}, "
                             f"got {self.sampling_defaults!r}")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, got {self.reasoning_parser!r}")

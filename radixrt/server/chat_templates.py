"""Chat templates by name (`--chat-template NAME`), as SGLang 0.5.9 accepts them.

SGLang's server takes `--chat-template` as a Jinja file or as the name of one
of its conversation templates (srt/parser/conversation.py); a named template
renders the messages to text with its own rules, the tokenizer encodes that
text as a prompt (adding BOS where the tokenizer does), and its stop strings
join the request's (unless ignore_eos). Here each name is a Jinja string
written to render exactly the text SGLang's template renders, and
`NamedTemplate` carries the other two rules. Carried: SGLang's names whose
text needs no images or files (chatml, qwen2-vl, llama-2, mistral, llama-4,
gemma-it, vicuna_v1.1, internlm2-chat, phi-4-mm), and `qwen` and
`llama-3-instruct`, which only SGLang's frontend registers (sglang.lang), in
that registry's form.

In SGLang's conversation templates the last system message replaces the
template's default one wherever it stands, the other messages alternate as
given, and a role other than system, user and assistant is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# --- SGLang's conversation templates (srt): `turns` are the user/assistant messages plus the
# blank assistant turn the reply goes in; ns.system is the last system message or the default.


def _conversation(default_system: str, body: str) -> str:
    head = (
        "{%- set ns = namespace(system=" + json.dumps(default_system) + ") -%}"
        "{%- for m in messages if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- endfor -%}"
        "{%- set turns = messages | rejectattr('role', 'equalto', 'system') | list -%}"
        "{%- for m in turns if m.role not in ['user', 'assistant'] -%}"
        "{{ raise_exception('this chat template takes system, user and assistant messages, not ' ~ m.role) }}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{%- set turns = turns + [{'role': 'assistant', 'content': none}] -%}{%- endif -%}"
    )
    return head + body


# <|im_start|>role\ncontent<|im_end|>\n per turn, after the system turn (SGLang's CHATML style)
_CHATML = (
    "{{ '<|im_start|>system\n' + ns.system + '<|im_end|>\n' }}"
    "{%- for m in turns -%}{{ '<|im_start|>' + m.role + '\n' }}"
    "{%- if m.content -%}{{ m.content + '<|im_end|>\n' }}{%- endif -%}{%- endfor -%}"
)


def _llama2(system_open: str, system_close: str) -> str:
    """LLAMA2 style: the system block opens the first [INST]; tags alternate by position, and
    the first message follows the opening without a tag of its own."""
    return (
        "{%- if ns.system -%}{{ " + json.dumps(system_open) + " + ns.system + " + json.dumps(system_close) + " }}"
        "{%- else -%}{{ '[INST] ' }}{%- endif -%}"
        "{%- for m in turns -%}{%- set tag = '[INST]' if loop.index0 % 2 == 0 else '[/INST]' -%}"
        "{%- if not m.content -%}{{ tag }}"
        "{%- elif loop.first -%}{{ m.content + ' ' }}"
        "{%- else -%}{{ tag + ' ' + m.content + (' ' if loop.index0 % 2 == 0 else ' </s><s>') }}"
        "{%- endif -%}{%- endfor -%}"
    )


_LLAMA4 = (
    "{%- if ns.system -%}{{ '<|header_start|>system<|header_end|>\n\n' + ns.system + '<|eot|>' }}{%- endif -%}"
    "{%- for m in turns -%}{{ '<|header_start|>' + m.role + '<|header_end|>\n\n' }}"
    "{%- if m.content -%}{{ (m.content | trim) + '<|eot|>' }}{%- endif -%}{%- endfor -%}"
)

# GEMMA3 style: the system text opens the first user turn, whose message follows it untagged
_GEMMA = (
    "{{ '<start_of_turn>user\n' + ns.system + '\n\n' }}"
    "{%- for m in turns -%}"
    "{%- set role = '<start_of_turn>user\n' if m.role == 'user' else '<start_of_turn>model\n' -%}"
    "{%- if not m.content -%}{{ role }}"
    "{%- elif loop.first -%}{{ m.content + '<end_of_turn>\n' }}"
    "{%- else -%}{{ role + m.content + '<end_of_turn>\n' }}{%- endif -%}{%- endfor -%}"
)

# ADD_COLON_TWO style: "ROLE: message" closed by " " after user turns and "</s>" after assistant ones
_VICUNA = (
    "{{ ns.system + ' ' }}"
    "{%- for m in turns -%}{%- set role = 'USER' if m.role == 'user' else 'ASSISTANT' -%}"
    "{%- if m.content -%}{{ role + ': ' + m.content + (' ' if loop.index0 % 2 == 0 else '</s>') }}"
    "{%- else -%}{{ role + ':' }}{%- endif -%}{%- endfor -%}"
)

# ADD_COLON_SINGLE style with InternLM2's role names
_INTERNLM2 = (
    "{{ '<|im_start|>system\n' + ns.system + '\n' }}"
    "{%- for m in turns -%}{%- set role = '<|im_start|>' + m.role -%}"
    "{%- if m.content -%}{{ role + ': ' + m.content + '\n' }}{%- else -%}{{ role + ':' }}{%- endif -%}{%- endfor -%}"
)

# NO_COLON_SINGLE style with Phi-4's role tokens
_PHI4 = (
    "{{ ns.system }}"
    "{%- for m in turns -%}{{ '<|' + m.role + '|>' }}{%- if m.content -%}{{ m.content + '<|end|>' }}{%- endif -%}{%- endfor -%}"
)


# --- SGLang's frontend templates (sglang.lang, PLAIN style): every message as prefix + content +
# suffix in order; the default system prompt first when the conversation does not start with one.


def _plain(default_system: str | None, prefix: str, suffix: str) -> str:
    """prefix may use `role`; the generation prompt is the assistant's prefix."""
    open_ = "(" + json.dumps(prefix).replace("{role}", '" + role + "') + ")"
    default = ""
    if default_system is not None:
        default = (
            "{%- if not messages or messages[0].role != 'system' -%}{%- set role = 'system' -%}"
            "{{ " + open_ + " + " + json.dumps(default_system) + " + " + json.dumps(suffix) + " }}{%- endif -%}"
        )
    return (
        default
        + "{%- for m in messages -%}{%- set role = m.role -%}"
        "{%- if role not in ['system', 'user', 'assistant'] -%}"
        "{{ raise_exception('this chat template takes system, user and assistant messages, not ' ~ role) }}{%- endif -%}"
        "{{ " + open_ + " + (m.content or '') + " + json.dumps(suffix) + " }}{%- endfor -%}"
        "{%- if add_generation_prompt -%}{%- set role = 'assistant' -%}{{ " + open_ + " }}{%- endif -%}"
    )


@dataclass(frozen=True)
class NamedTemplate:
    """A registered chat template: its Jinja source and the strings that end its turns."""

    name: str
    source: str
    stop: tuple[str, ...] = ()

    def render_ids(self, tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
        """The prompt's token ids: the rendered text encoded as a prompt (BOS where the tokenizer
        adds one), as SGLang encodes a conversation template's text. Tools are not rendered."""
        text = tokenizer.apply_chat_template(messages, chat_template=self.source, add_generation_prompt=True,
                                             tokenize=False)
        return list(tokenizer.encode(text))

    def stops_with(self, stop: str | list[str] | None) -> list[str]:
        """The template's stop strings, then the request's (SGLang's order)."""
        given = [stop] if isinstance(stop, str) else list(stop or [])
        return [*self.stop, *given]


NAMED_TEMPLATES: dict[str, NamedTemplate] = {t.name: t for t in (
    NamedTemplate("chatml", _conversation("You are a helpful assistant.", _CHATML), ("<|endoftext|>", "<|im_end|>")),
    NamedTemplate("qwen2-vl", _conversation("You are a helpful assistant.", _CHATML), ("<|im_end|>",)),
    NamedTemplate("llama-2", _conversation("", _llama2("[INST] <<SYS>>\n", "\n<</SYS>>\n\n")),
                  ("[INST]", "[/INST]", "<<SYS>>", "<</SYS>>")),
    NamedTemplate("mistral", _conversation("", _llama2("[SYSTEM_PROMPT]\n", "\n[/SYSTEM_PROMPT]\n\n")),
                  ("[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]")),
    NamedTemplate("llama-4", _conversation("", _LLAMA4), ("<|end_of_text|>", "<|eot|>", "<|eom|>")),
    NamedTemplate("gemma-it", _conversation("You are a helpful assistant.", _GEMMA), ("<end_of_turn>",)),
    NamedTemplate("vicuna_v1.1", _conversation(
        "A chat between a curious user and an artificial intelligence assistant. "
        "The assistant gives helpful, detailed, and polite answers to the user's questions.", _VICUNA)),
    NamedTemplate("internlm2-chat", _conversation("", _INTERNLM2), ("<|im_end|>", "<|action_end|>")),
    NamedTemplate("phi-4-mm", _conversation("", _PHI4), ("<|end|>",)),
    NamedTemplate("qwen", _plain("You are a helpful assistant.", "<|im_start|>{role}\n", "<|im_end|>\n"), ("<|im_end|>",)),
    NamedTemplate("llama-3-instruct", _plain(None, "<|start_header_id|>{role}<|end_header_id|>\n\n", "<|eot_id|>"),
                  ("<|eot_id|>",)),
)}


def named_template(arg: str | None) -> NamedTemplate | None:
    """The registered template --chat-template names, or None (a file, or no override). As in
    SGLang, a name wins over a file of the same name."""
    return NAMED_TEMPLATES.get(arg) if arg else None

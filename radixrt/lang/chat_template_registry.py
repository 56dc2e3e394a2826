"""The chat templates by name, and which one a model path gets: SGLang's frontend choice.

`chat_template_for(model_path)` walks MATCHERS in order and takes the first that
matches (case-insensitive regex search on the path, as SGLang's
`get_chat_template_by_model_path` does); no match means "default"
(`SYSTEM:`/`USER:`/`ASSISTANT:` lines, no stop string). The names, order and
texts follow SGLang 0.5.9 so that a program renders the same prompt in both
frontends; tests/test_lang_sglang_parity.py holds us to SGLang's own table.

Left out: image and audio tokens (the DSL sends text only), and the four
templates whose default system prompt is vendor prose (dbrx-instruct,
internvl-2-5, interns1, yi-vl). A model path SGLang maps to one of those is an
error naming the template, not a silent fall back to another.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .chat_template import ChatTemplate, Llama2ChatTemplate

ROLES = ("system", "user", "assistant")
HELPFUL = "You are a helpful assistant."
VICUNA_SYSTEM = ("A chat between a curious user and an artificial intelligence assistant. "
                 "The assistant gives helpful, detailed, and polite answers to the user's questions.")
NOT_CARRIED = ("dbrx-instruct", "internvl-2-5", "interns1", "yi-vl")


def _tagged(start: str, end: str, suffix: str, assistant: str = "assistant") -> dict[str, tuple[str, str]]:
    """Roles written `{start}{role}{end}` ... `{suffix}` (the assistant role may go by another name)."""
    names = {"system": "system", "user": "user", "assistant": assistant}
    return {r: (f"{start}{names[r]}{end}", suffix) for r in ROLES}


CHATML_ROLES = _tagged("<|im_start|>", "\n", "<|im_end|>\n")
LLAMA3_ROLES = _tagged("<|start_header_id|>", "<|end_header_id|>\n\n", "<|eot_id|>")
DEEPSEEK_ROLES = {"system": ("", ""), "user": ("<｜User｜>", ""), "assistant": ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")}
MINICPM_ROLES = {"system": ("", " "), "user": ("user:", " "), "assistant": ("assistant:", "</s>")}
IM_END, EOT_ID, DEEPSEEK_END = ("<|im_end|>",), ("<|eot_id|>",), ("<｜end▁of▁sentence｜>",)

_TEMPLATES = [
    ChatTemplate("default", {"system": ("SYSTEM:", "\n"), "user": ("USER:", "\n"), "assistant": ("ASSISTANT:", "\n")}),
    ChatTemplate("claude", {"system": ("", ""), "user": ("\n\nHuman: ", ""), "assistant": ("\n\nAssistant:", "")}),
    ChatTemplate("chatml", CHATML_ROLES, IM_END),
    ChatTemplate("chatml-llava", CHATML_ROLES, IM_END, HELPFUL),
    ChatTemplate("qwen", CHATML_ROLES, IM_END, HELPFUL),
    ChatTemplate("qwen2-vl", CHATML_ROLES, IM_END, HELPFUL),
    ChatTemplate("vicuna_v1.1", {"system": ("", " "), "user": ("USER:", " "), "assistant": ("ASSISTANT:", "</s>")},
                 (), VICUNA_SYSTEM),
    Llama2ChatTemplate("llama-2-chat", {"system": ("<<SYS>>\n", "\n<</SYS>>\n\n"), "user": ("[INST] ", " [/INST]"),
                                        "assistant": ("", " </s><s>")}),
    ChatTemplate("mistral", {"system": ("[SYSTEM_PROMPT] ", " [/SYSTEM_PROMPT]"), "user": ("[INST] ", " [/INST]"),
                             "assistant": ("", " </s><s>")}, ("</s>",)),
    ChatTemplate("llama-3-instruct", LLAMA3_ROLES, EOT_ID),
    ChatTemplate("llama-3-instruct-llava", LLAMA3_ROLES, EOT_ID),
    ChatTemplate("llama-4", _tagged("<|header_start|>", "<|header_end|>\n\n", "<|eot|>"), ("<|eot|>",)),
    ChatTemplate("minicpmv", MINICPM_ROLES, ("<|im_end|>", "<|endoftext|>")),
    ChatTemplate("minicpmo", MINICPM_ROLES, ("<|im_end|>", "<|endoftext|>")),
    # NOTE: SGLang spells janus-pro's user role "User", so a `user` turn gets no markup there; kept for parity.
    ChatTemplate("janus-pro", {**DEEPSEEK_ROLES, "user": ("", "")}, DEEPSEEK_END),
    ChatTemplate("janus", DEEPSEEK_ROLES, DEEPSEEK_END),
    ChatTemplate("yi-1.5", {"system": ("", ""), "user": ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
                            "assistant": ("", "<|im_end|>\n")}, IM_END),
    ChatTemplate("gemma-it", {"system": ("", ""), "user": ("<start_of_turn>user\n", "<end_of_turn>\n"),
                              "assistant": ("<start_of_turn>model\n", "<end_of_turn>\n")}),
    ChatTemplate("c4ai-command-r", {
        "system": ("<|START_OF_TURN_TOKEN|><|SYSTEM_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
        "user": ("<|START_OF_TURN_TOKEN|><|USER_TOKEN|>", "<|END_OF_TURN_TOKEN|>"),
        "assistant": ("<|START_OF_TURN_TOKEN|><|CHATBOT_TOKEN|>", "<|END_OF_TURN_TOKEN|>")}),
    ChatTemplate("granite-3-instruct", _tagged("<|start_of_role|>", "<|end_of_role|>", "<|end_of_text|>"),
                 ("<|end_of_text|>",)),
    ChatTemplate("deepseek-v3", DEEPSEEK_ROLES, DEEPSEEK_END),
    ChatTemplate("glm-4v", {r: (f"<|{r}|>\n", "\n") for r in ROLES}, ("<|user|>", "<|endoftext|>", "<|observation|>")),
]
TEMPLATES: dict[str, ChatTemplate] = {t.name: t for t in _TEMPLATES}


@dataclass(frozen=True)
class Matcher:
    """A path gets `template` when every `all_of` pattern is found in it and no `none_of` one is."""

    template: str
    all_of: tuple[str, ...]
    none_of: tuple[str, ...] = ()

    def matches(self, path: str) -> bool:
        found = lambda pattern: re.search(pattern, path, re.IGNORECASE) is not None  # noqa: E731
        return all(map(found, self.all_of)) and not any(map(found, self.none_of))


# SGLang's matching functions, flattened in their registration order: the first match wins.
MATCHERS: tuple[Matcher, ...] = (
    Matcher("deepseek-v3", (r"deepseek-(v3|r1)",), (r"base",)),
    Matcher("claude", (r"orion",)),
    Matcher("janus-pro", (r"janus",)),
    Matcher("dbrx-instruct", (r"dbrx", r"instruct")),
    Matcher("vicuna_v1.1", (r"vicuna|llava-v1\.5|llava-next-video-7b",)),
    Matcher("llama-2-chat", (r"llama-2.*chat|codellama.*instruct",)),
    Matcher("mistral", (r"pixtral|(mistral|mixtral).*instruct",)),
    Matcher("llama-3-instruct", (r"llama-3.*instruct",)),
    Matcher("chatml", (r"tinyllama",)),
    Matcher("qwen2-vl", (r"qwen.*vl",)),
    Matcher("glm-4v", (r"glm[-_]?4(\.\d+)?v",)),
    Matcher("qwen", (r"qwen.*(chat|instruct)",), (r"llava",)),
    Matcher("chatml-llava", (r"llava-v1\.6-34b|llava-v1\.6-yi-34b|llava-next-video-34b|llava-onevision-qwen2",)),
    Matcher("yi-vl", (r"yi-vl",), (r"llava",)),
    Matcher("yi-1.5", (r"yi-1\.5.*chat",)),
    Matcher("gemma-it", (r"gemma.*it",)),
    Matcher("minicpmv", (r"minicpm-v",)),
    Matcher("minicpmo", (r"minicpm-o",)),
    Matcher("c4ai-command-r", (r"c4ai-command-r",)),
    Matcher("granite-3-instruct", (r"granite.*instruct",)),
    Matcher("gemma-it", (r"gemma-3",)),
    Matcher("internvl-2-5", (r"internvl2_5",)),
    Matcher("interns1", (r"intern-s1|interns1",)),
)


def get_chat_template(name: str) -> ChatTemplate:
    if name in NOT_CARRIED:
        raise ValueError(f"radixrt.lang does not carry SGLang's {name!r} chat template (its system prompt is "
                         f"vendor prose); pass chat_template_name= one of {sorted(TEMPLATES)}")
    if name not in TEMPLATES:
        raise ValueError(f"unknown chat template {name!r}; known: {sorted(TEMPLATES)}")
    return TEMPLATES[name]


def template_name_for(model_path: str) -> str:
    """The name SGLang's frontend picks for `model_path` ("default" when nothing matches)."""
    return next((m.template for m in MATCHERS if m.matches(model_path)), "default")


def chat_template_for(model_path: str) -> ChatTemplate:
    name = template_name_for(model_path)
    if name in NOT_CARRIED:
        raise ValueError(f"SGLang renders {model_path!r} with its {name!r} chat template, which radixrt.lang does "
                         f"not carry; pass chat_template_name= one of {sorted(TEMPLATES)}")
    return TEMPLATES[name]

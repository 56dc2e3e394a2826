"""radixrt/reasoning.py: every format's whole-text split, and streams cut at every character
boundary (so at every token boundary) that join to the whole-text split."""

from __future__ import annotations

import itertools

import pytest

from radixrt.config import ServerArgs
from radixrt.reasoning import (
    FORMATS,
    REASONING_PARSERS,
    ReasoningStream,
    Separated,
    chat_forced,
    count_reasoning_tokens,
    get_format,
    separate,
    template_forces_reasoning,
    thinks,
)

# SGLang 0.5.9's ReasoningParser.DetectorMap, less minimax-append-think (it separates nothing)
SGLANG_NAMES = {"deepseek-r1", "deepseek-v3", "glm45", "gpt-oss", "kimi", "kimi_k2", "qwen3", "qwen3-thinking",
                "minimax", "step3", "step3p5", "nano_v3", "interns1"}


def output(name: str, reasoning: str = " Let me see.\n2 < 3 </thin\n", content: str = "\n\nIt is <b>3</b>.") -> str:
    """A model's text in the format: start marker, reasoning, end marker, content (with a partial
    end marker and a '<' inside the reasoning, and whitespace around both parts)."""
    fmt = get_format(name)
    header = fmt.content_headers[0] if fmt.content_headers else ""
    return f"{fmt.think_start}{reasoning}{fmt.think_end}{header}{content}"


def streamed(text: str, cuts: list[int], name: str, forced: bool | None = None, stream_reasoning: bool = True
             ) -> tuple[Separated, list[Separated]]:
    s = ReasoningStream(name, forced, stream_reasoning)
    bounds = [0, *cuts, len(text)]
    pieces = [s.feed(text[a:b]) for a, b in itertools.pairwise(bounds)] + [s.finish()]
    return Separated("".join(p.reasoning for p in pieces), "".join(p.content for p in pieces)), pieces


def test_the_names_are_sglangs_and_the_flag_takes_them(llama_path):
    assert set(REASONING_PARSERS) == SGLANG_NAMES
    assert ServerArgs(model_path=str(llama_path), reasoning_parser="qwen3").reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="reasoning_parser must be one of .*qwen3-thinking"):
        ServerArgs(model_path=str(llama_path), reasoning_parser="qwen4")
    with pytest.raises(ValueError, match="unknown reasoning parser 'qwen4'; choices: deepseek-r1"):
        get_format("qwen4")
    assert get_format("DeepSeek-R1").name == "deepseek-r1"  # SGLang lower-cases the name


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_whole_text(name):
    fmt = get_format(name)
    assert separate(output(name), name) == ("Let me see.\n2 < 3 </thin", "It is <b>3</b>.")
    # no start marker: forced formats reason from the start, the others answer
    bare = f"thinking{fmt.think_end}answer"
    expected = ("thinking", "answer") if fmt.forced_by_default else ("", bare)
    assert separate(bare, name) == expected
    assert separate(bare, name, forced=True) == ("thinking", "answer")
    assert separate("just an answer\n", name, forced=False) == ("", "just an answer\n")
    # cut short before the end marker: all reasoning
    assert separate(f"{fmt.think_start}half a thou", name) == ("half a thou", "")
    assert separate(f"  {fmt.think_start}\n{fmt.think_end}", name) == ("", "")
    # only the first end marker ends the reasoning; later markers are content
    assert separate(f"{fmt.think_start}a{fmt.think_end}b{fmt.think_start}c{fmt.think_end}", name) == (
        "a", f"b{fmt.think_start}c{fmt.think_end}")


@pytest.mark.parametrize("stream_reasoning", [True, False], ids=["stream_reasoning", "whole_reasoning"])
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_a_stream_cut_anywhere_joins_to_the_whole_text_split(name, stream_reasoning):
    fmt = get_format(name)
    texts = [output(name), output(name, reasoning="", content=""), f"x{fmt.think_end} y", f" {fmt.think_start}ab"]
    for text in texts:
        for forced in (True, False):
            whole = separate(text, name, forced)
            for cut in range(len(text) + 1):  # every single boundary, and every character its own delta
                assert streamed(text, [cut], name, forced, stream_reasoning)[0] == whole, (text, cut)
            joined, pieces = streamed(text, list(range(1, len(text))), name, forced, stream_reasoning)
            assert joined == whole, text
            if not stream_reasoning:  # the reasoning in one piece
                assert sum(1 for p in pieces if p.reasoning) <= 1


def test_a_stream_holds_back_only_what_may_be_a_marker():
    s = ReasoningStream("qwen3", forced=False)
    assert s.feed("<thi") == ("", "")
    assert s.feed("nk>abc </") == ("abc", "")  # ' </' may be where the reasoning ends
    assert s.feed("b> d") == (" </b> d", "")
    assert s.feed("</think>\n") == ("", "")
    assert s.feed("\nok") == ("", "ok")
    assert s.finish() == ("", "")
    plain = ReasoningStream("qwen3", forced=False)
    assert plain.feed("hello <think>") == ("", "hello <think>")  # a start marker counts only at the start


def test_stream_reasoning_false_sends_the_reasoning_once_it_ends():
    s = ReasoningStream("deepseek-r1", stream_reasoning=False)
    assert s.feed("step one, ") == ("", "")
    assert s.feed("step two</think>") == ("step one, step two", "")
    assert s.feed("done") == ("", "done")
    cut_short = ReasoningStream("deepseek-r1", stream_reasoning=False)
    assert cut_short.feed("never ends") == ("", "")
    assert cut_short.finish() == ("never ends", "")


def test_gpt_oss_harmony_channels():
    text = ("<|channel|>analysis<|message|>User asks 2+2.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>4")
    assert separate(text, "gpt-oss") == ("User asks 2+2.", "4")
    assert get_format("gpt-oss").think_end == "<|end|>"


def test_thinks_follows_sglangs_rule():
    assert thinks("qwen3", None) and thinks("qwen3", {}) and thinks("qwen3", {"enable_thinking": True})
    assert not thinks("qwen3", {"enable_thinking": False})
    assert not thinks("deepseek-v3", None) and not thinks("deepseek-v3", {"thinking": "yes"})
    assert thinks("deepseek-v3", {"thinking": True})
    assert thinks("kimi_k2", {}) and not thinks("kimi_k2", {"thinking": False})
    assert thinks("deepseek-r1", {"enable_thinking": False})  # the others always think
    # in chat: per request for qwen3 and its kin, always for the forced formats, never for kimi
    assert chat_forced("qwen3", None) and not chat_forced("qwen3", {"enable_thinking": False})
    assert chat_forced("qwen3", {"enable_thinking": False}, template_forced=True)
    assert chat_forced("qwen3-thinking", {"enable_thinking": False}) and not chat_forced("kimi", None)
    assert template_forces_reasoning("{{- '<|im_start|>assistant\\n<think>\\n' }}")
    assert not template_forces_reasoning(None) and not template_forces_reasoning("<|im_start|>assistant\\n")


def test_reasoning_tokens_count_up_to_the_end_markers_last_token():
    tokens = ["<", "th", "ink", ">", "ab", "c", "</", "think", ">", "de", "f"]
    text_of = lambda k: "".join(tokens[:k])
    assert count_reasoning_tokens(len(tokens), text_of, "qwen3") == (9, True)
    assert count_reasoning_tokens(6, text_of, "qwen3") == (6, False)  # not ended yet: all of them
    answer = ["plain", " answer"]
    assert count_reasoning_tokens(2, lambda k: "".join(answer[:k]), "qwen3") == (0, False)
    assert count_reasoning_tokens(2, lambda k: "".join(answer[:k]), "qwen3", forced=True) == (2, False)
    assert count_reasoning_tokens(0, lambda k: "", "deepseek-r1") == (0, False)

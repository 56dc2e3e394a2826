"""require_reasoning: a grammar that starts after the reasoning's end marker (constrained/reasoning_gate.py),
on the tiny model's real tokenizer (where "</think>" is several tokens). Through a server:
tests/test_reasoning_server.py."""

from __future__ import annotations

import pytest
from support.helpers import tokenizer

from radixrt.constrained.grammar import GrammarCompiler
from radixrt.constrained.reasoning_gate import ReasoningGate
from radixrt.scheduler.grammars import reasoning_end_ids


@pytest.fixture(scope="module")
def tok(llama_path):
    return tokenizer(llama_path)


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, len(tok), [tok.eos_token_id])


def test_no_mask_until_the_marker_then_the_grammar(tok, compiler):
    end = reasoning_end_ids(tok, "qwen3")
    assert len(end) > 1 and tok.decode(list(end)) == "</think>"
    gate = ReasoningGate(compiler.matcher(compiler.compile("regex", "[ab]{2}")), end)
    thinking = tok.encode("let me think </thi", add_special_tokens=False)
    for t in thinking + list(end[:-1]):
        assert gate.allowed() == b"" and gate.forced_text(64).text == "" and not gate.finished
        assert gate.accept(t)  # anything goes while reasoning
    assert gate.accept(end[-1]) and not gate.reasoning
    plain = compiler.matcher(compiler.compile("regex", "[ab]{2}"))
    assert gate.allowed() == plain.allowed() != b""
    a = tok.encode("a", add_special_tokens=False)[0]
    assert not gate.accept(tok.encode("z", add_special_tokens=False)[0])  # the grammar holds from here
    assert gate.accept(a) and gate.accept(a)
    assert gate.allowed() == b"".join(
        [(1 << (tok.eos_token_id % 32)).to_bytes(4, "little") if w == tok.eos_token_id // 32 else bytes(4)
         for w in range(len(plain.allowed()) // 4)])  # only the stop token is left
    assert gate.accept(tok.eos_token_id) and gate.terminated and gate.finished


def test_rollback_undoes_only_the_grammars_tokens(tok, compiler):
    end = reasoning_end_ids(tok, "deepseek-r1")
    gate = ReasoningGate(compiler.matcher(compiler.compile("regex", "[ab]{3}")), end)
    for t in end:
        gate.accept(t)
    a = tok.encode("a", add_special_tokens=False)[0]
    gate.accept(a)
    gate.accept(a)
    gate.rollback(2)
    assert gate.after == 0 and gate.allowed() == compiler.matcher(compiler.compile("regex", "[ab]{3}")).allowed()
    gate.rollback(1)  # past the grammar's start: reasoning again
    assert gate.reasoning and gate.allowed() == b""


def test_without_reasoning_the_gate_is_the_grammar(tok, compiler):
    gate = ReasoningGate(compiler.matcher(compiler.compile("regex", "[ab]{2}")), (1, 2), reasoning=False)
    assert gate.allowed() == compiler.matcher(compiler.compile("regex", "[ab]{2}")).allowed()
    assert reasoning_end_ids(tok, None) == ()


"""The grammar layer alone: compile cache, masks (packed and applied), a vocabulary larger than
the tokenizer's, when a grammar is finished, and refusals that name the field."""

from __future__ import annotations

import json

import pytest
import torch
from support.helpers import tokenizer
from radixrt.constrained.grammar import GrammarCompiler
from radixrt.errors import RequestError
from radixrt.worker.sampler import mask_disallowed


def allowed_ids(packed: bytes) -> list[int]:
    """The token ids a packed mask (Matcher.allowed) lets through."""
    words = torch.frombuffer(bytearray(packed), dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.view(-1).nonzero().view(-1).tolist()


@pytest.fixture(scope="module")
def tok(llama_path):
    return tokenizer(llama_path)


def test_compiles_once_per_kind_and_text(tok):
    c = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    a = c.compile("regex", "[ab]{2}")
    assert c.compile("regex", "[ab]{2}") is a and c.compile("ebnf", 'root ::= "ab"') is not a
    with pytest.raises(RequestError, match="sampling_params.json_schema is not a valid grammar") as e:
        c.compile("json_schema", "{not json")
    assert e.value.param == "json_schema"


def test_padding_ids_past_the_tokenizer_are_never_allowed(tok):
    vocab = len(tok) + 77  # the model's logits are wider than the tokenizer's vocabulary
    c = GrammarCompiler(tok, vocab, [tok.eos_token_id])
    for kind, text in (("regex", ".{1,3}"), ("json_schema", json.dumps({"type": "string"}))):
        m = c.matcher(c.compile(kind, text))
        ids = allowed_ids(m.allowed())
        assert ids and max(ids) < len(tok)
        assert len(m.allowed()) * 8 >= vocab


def test_a_complete_grammar_with_only_stop_tokens_left_is_finished(tok):
    c = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    m = c.matcher(c.compile("regex", "(ab|abc)"))
    ids = tok.encode("ab", add_special_tokens=False)
    assert all(m.accept(t) for t in ids)
    assert not m.finished  # "c" may still follow
    m = c.matcher(c.compile("regex", "ab"))
    assert all(m.accept(t) for t in ids) and m.finished and not m.terminated
    assert set(allowed_ids(m.allowed())) == {tok.eos_token_id}
    assert m.accept(tok.eos_token_id) and m.terminated
    assert not c.matcher(c.compile("regex", "ab")).accept(tok.encode("zz", add_special_tokens=False)[0])


def test_mask_disallowed_keeps_exactly_the_allowed_ids():
    vocab = 70  # not a multiple of 32: the last word is partial
    keep = [[0, 31, 32, 69], [5]]
    packed = []
    for ids in keep:
        words = [0] * 3
        for t in ids:
            words[t // 32] |= 1 << (t % 32)
        packed.append(b"".join(w.to_bytes(4, "little", signed=False) for w in words))
    assert [allowed_ids(p) for p in packed] == keep
    logits = torch.randn(3, vocab)
    before = logits.clone()
    mask_disallowed(logits, [0, 2], packed)
    for row, ids in ((0, keep[0]), (2, keep[1])):
        finite = torch.isfinite(logits[row]).nonzero().view(-1).tolist()
        assert finite == ids and torch.equal(logits[row, ids], before[row, ids])
    assert torch.equal(logits[1], before[1])  # an unconstrained row is untouched


# Grammars whose forced text xgrammar's own (unbounded) walk finds quickly: ours must agree.
FINITE_FORCED = [
    ("ebnf", 'root ::= "{\\"name\\": \\"" [a-z]+ "\\"}"'),
    ("regex", "a{40}(b|c)"),
    ("regex", "(hello world|help)"),
    ("regex", "é{3}x"),  # multi-byte characters, forced whole
    ("regex", "(é|è)"),  # a shared first byte only: no whole character is forced
    ("json_schema", json.dumps({"type": "object", "properties": {"alpha": {"type": "integer"}}, "required": ["alpha"]})),
]


@pytest.mark.parametrize("kind,text", FINITE_FORCED)
def test_forced_text_equals_xgrammars_walk_and_stops_at_its_limit(tok, kind, text):
    c = GrammarCompiler(tok, len(tok), [tok.eos_token_id], any_whitespace=False)
    m = c.matcher(c.compile(kind, text))
    want = m._matcher.find_jump_forward_string()
    assert m.forced_text(10_000) == (want, False)
    for limit in range(1, len(want.encode()) + 1):
        got, cut = m.forced_text(limit)
        assert cut and want.startswith(got) and len(want.encode()[:limit].decode("utf-8", "ignore")) == len(got)
    ids = tok.encode("{", add_special_tokens=False) if kind != "regex" else []
    if all(m.accept(t) for t in ids):  # a step in: the rest is forced from there, the matcher unmoved by the walks
        assert m.forced_text(10_000).text == m._matcher.find_jump_forward_string()


def test_an_endless_forced_text_is_walked_only_to_the_limit(tok):
    """xgrammar's own walk never returns on `root ::= "a" root` (its memory grows until the process
    dies); a bounded walk returns `limit` bytes at once."""
    c = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    for kind, text in (("ebnf", 'root ::= "a" root'), ("regex", "a{10000000}")):
        m = c.matcher(c.compile(kind, text))
        assert m.forced_text(300) == ("a" * 300, True)


def test_a_grammar_that_accepts_no_string_is_refused(tok):
    c = GrammarCompiler(tok, len(tok), [tok.eos_token_id])
    with pytest.raises(RequestError, match="sampling_params.ebnf accepts no string") as e:
        c.compile("ebnf", "root ::= root")
    assert e.value.param == "ebnf"
    assert not c.matcher(c.compile("regex", "a?")).dead_end  # the empty string is a string

"""Bounded JSON whitespace: the grammar lets no more than the bound's whitespace characters run
between JSON tokens (and leaves regex grammars alone), and the flags that set the bound:
--constrained-json-max-whitespace, SGLang's --constrained-json-whitespace-pattern ([chars]{0,n}
only) and --constrained-json-disable-any-whitespace."""

from __future__ import annotations

import json

import pytest
from support.helpers import tokenizer
from test_grammar import allowed_ids

from radixrt.config import ServerArgs
from radixrt.settings.constrained import JSON_MAX_WHITESPACE
from radixrt.constrained.grammar import GrammarCompiler
from radixrt.server.openai_api import JSON_OBJECT_SCHEMA

RECORD = json.dumps({"type": "object", "properties": {"city": {"enum": ["Paris", "Lima"]}, "code": {"type": "string", "maxLength": 4}},
                     "required": ["city", "code"], "additionalProperties": False})


@pytest.fixture(scope="module")
def tok(llama_path):
    return tokenizer(llama_path)


def _leading_whitespace(text: str) -> int:
    return len(text) - len(text.lstrip(" \n\t\r"))


def _longest_allowed_whitespace(tok, matcher) -> int:
    """The most whitespace characters any token allowed next starts with."""
    return max((_leading_whitespace(tok.decode([t])) for t in allowed_ids(matcher.allowed())), default=0)


@pytest.mark.parametrize("bound", [1, 2, 4])
@pytest.mark.parametrize("schema", [RECORD, JSON_OBJECT_SCHEMA])
def test_no_whitespace_token_past_the_bound(tok, bound, schema):
    """After "{" and k single spaces, no allowed token starts with more than bound - k whitespace
    characters (the vocabulary has "  ", "\\n  " and "\\n   " too), and with k = bound none does."""
    c = GrammarCompiler(tok, len(tok), [tok.eos_token_id], max_whitespace=bound)
    m = c.matcher(c.compile("json_schema", schema))
    (space,) = tok.encode(" ", add_special_tokens=False)
    assert all(m.accept(t) for t in tok.encode("{", add_special_tokens=False))
    for k in range(bound + 1):
        assert _longest_allowed_whitespace(tok, m) == min(bound - k, 4)  # 4: the longest whitespace token
        if k < bound:
            assert m.accept(space)
    assert not m.accept(space)


def test_unbounded_compact_and_regex_grammars(tok):
    """None allows the longest whitespace token anywhere; 0 (any_whitespace=False, the same) none
    after "{"; a regex's own spaces are not JSON's, so no bound applies to them."""
    for setting, longest in (({"max_whitespace": None}, 4), ({"max_whitespace": 0}, 0), ({"any_whitespace": False}, 0)):
        c = GrammarCompiler(tok, len(tok), [tok.eos_token_id], **setting)
        m = c.matcher(c.compile("json_schema", RECORD))
        assert all(m.accept(t) for t in tok.encode("{", add_special_tokens=False))
        assert _longest_allowed_whitespace(tok, m) == longest, setting
    c = GrammarCompiler(tok, len(tok), [tok.eos_token_id], max_whitespace=1)
    m = c.matcher(c.compile("regex", "x {6}y"))
    assert all(m.accept(t) for t in tok.encode("x      y", add_special_tokens=False)) and m.finished


def _bound(**flags) -> int | None:
    return ServerArgs(model_path="unused", **flags).json_max_whitespace


def test_flags_set_the_bound():
    assert _bound() == JSON_MAX_WHITESPACE
    assert _bound(constrained_json_max_whitespace=-1) is None
    assert _bound(constrained_json_max_whitespace=2) == 2
    assert _bound(constrained_json_disable_any_whitespace=True) == 0
    for pattern, bound in ((r"[\n\t ]{0,2}", 2), ("[\n ]{0,3}", 3), (r"[\s]{0,1}", 1), (r"[ ]{0,0}", 0), (r"[\n\t\r ]*", None)):
        assert _bound(constrained_json_whitespace_pattern=pattern) == bound, pattern


@pytest.mark.parametrize("pattern", [r"[\n\t ]{1,2}", r"\s*", r"[a ]{0,2}", r"[ ]{0, 2}", r"[\n ]+", "", r"[ ]{0,2}x"])
def test_other_patterns_are_refused_by_name(pattern):
    with pytest.raises(ValueError, match="constrained_json_whitespace_pattern must be"):
        ServerArgs(model_path="unused", constrained_json_whitespace_pattern=pattern)


def test_conflicting_whitespace_flags_are_refused():
    with pytest.raises(ValueError, match="constrained_json_max_whitespace must be"):
        ServerArgs(model_path="unused", constrained_json_max_whitespace=-2)
    for other in ({"constrained_json_disable_any_whitespace": True}, {"constrained_json_max_whitespace": 8}):
        with pytest.raises(ValueError, match="give one of them"):
            ServerArgs(model_path="unused", constrained_json_whitespace_pattern=r"[ ]{0,2}", **other)

"""Constrained generation in the DSL: gen's regex / json_schema / choices / dtype.

The first half needs no server: it checks what a program asks for (the request bodies a
RuntimeEndpoint would send) and the dtype regexes. The second half runs programs on the
shared tiny random-weight server, where only a constrained output can be a valid one.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest

import radixrt as rt
import support.recording_endpoint
from radixrt.lang.constraints import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR, dtype_rule
from radixrt.lang.choices import greedy_token_selection, token_length_normalized
from radixrt.lang.ir import Select

LETTERS = "[ab]{3}"
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["n"],
    "additionalProperties": False,
}
COLORS = ["red", "green", "blue"]


class RecordingEndpoint(support.recording_endpoint.RecordingEndpoint):
    def generated(self) -> list[dict[str, Any]]:
        """The sampling_params of the requests that generate (not fork's prefill-only ones)."""
        return [b["sampling_params"] for b in self.bodies if b["sampling_params"].get("max_new_tokens") != 0]


# --- without a server ---

DTYPE_CASES = [
    (int, ["-12", "0", "42", "+7", "7 ", "3\n"], ["", "-", "1.5", "abc", "1e3", " 7"]),
    (float, ["3.5", "-0.25", ".5", "4", "+10.0", "2.5 "], ["", ".", "3.", "1e3", "--1", "1.2.3", "nan"]),
    (bool, ["True", "False"], ["true", "false", "1", "TrueFalse", "True "]),
    (str, ['"hello world"', '""', '"a1_b\tc"'], ["hello", '"open', '"a"b"', '"say \\"hi\\""']),
]


@pytest.mark.parametrize("dtype, good, bad", DTYPE_CASES, ids=lambda c: c.__name__ if isinstance(c, type) else None)
def test_dtype_regexes_accept_their_values_only(dtype, good, bad):
    regex = dtype_rule(dtype).regex
    assert dtype_rule(dtype.__name__) == dtype_rule(dtype)
    assert [s for s in good if not re.fullmatch(regex, s)] == []
    assert [s for s in bad if re.fullmatch(regex, s)] == []


def test_gen_dtype_becomes_a_regex_and_numbers_stop_at_whitespace():
    assert (rt.gen("n", dtype=int).params.regex, rt.gen("n", dtype=int).params.stop) == (REGEX_INT, (" ", "\n"))
    assert rt.gen("x", dtype="float", stop="!").params.stop == ("!", " ", "\n")
    assert (rt.gen("b", dtype=bool).params.regex, rt.gen("b", dtype=bool).params.stop) == (REGEX_BOOL, None)
    assert rt.gen("s", dtype=str).params.regex == REGEX_STR
    assert rt.gen("f", dtype=float).params.regex == REGEX_FLOAT
    with pytest.raises(ValueError, match="dtype must be int, float, bool or str"):
        rt.gen("c", dtype=complex)


def test_gen_with_choices_is_select():
    made = rt.gen("color", choices=COLORS, temperature=0, choices_method=greedy_token_selection)
    plain = rt.select("color", COLORS, choices_method=greedy_token_selection)
    assert isinstance(made, Select) and (made.name, made.choices, made.method) == (plain.name, plain.choices, plain.method)
    assert rt.select("color", COLORS).method is token_length_normalized
    with pytest.raises(ValueError, match="does not sample"):  # SGLang asserts it when the select runs
        rt.gen("color", choices=COLORS, temperature=0.5)
    with pytest.raises(ValueError, match="at least one choice"):
        rt.gen("color", choices=[])


@pytest.mark.parametrize("given", [
    {"regex": "[0-9]+", "json_schema": SCHEMA},
    {"regex": "[0-9]+", "dtype": int},
    {"json_schema": SCHEMA, "choices": COLORS},
    {"choices": COLORS, "dtype": bool},
    {"regex": "a", "json_schema": "{}", "choices": ["a"], "dtype": str},
])
def test_at_most_one_constraint_per_gen(given):
    with pytest.raises(ValueError, match=" and ".join(given)):
        rt.gen("x", **given)


@rt.function
def complete(s) -> None:
    s += "Q: " + rt.gen("free", max_tokens=4)


def test_bad_constraints_fail_where_the_program_defines_them():
    with pytest.raises(ValueError, match="does not compile"):
        rt.gen("x", regex="[0-9")
    with pytest.raises(ValueError, match="not valid JSON"):
        rt.gen("x", json_schema="{'type': 'object'}")
    with pytest.raises(ValueError, match="must be a JSON object"):
        rt.gen("x", json_schema="[1, 2]")
    with pytest.raises(ValueError, match="not JSON-serializable"):
        rt.gen("x", json_schema={"type": object()})
    with pytest.raises(ValueError, match="regex and json_schema"):
        complete.run(backend=RecordingEndpoint(), regex="[0-9]+", json_schema=SCHEMA)


@rt.function
def constrained(s, schema: dict[str, Any] | str) -> None:
    s += "Letters: " + rt.gen("letters", regex=LETTERS, max_tokens=8)
    s += "\nJSON: " + rt.gen("obj", json_schema=schema, max_tokens=32)
    s += rt.assistant(rt.gen("count", dtype=int, max_tokens=8))
    s += "\nFree: " + rt.gen("free", max_tokens=4)


def test_request_bodies_carry_the_constraints_exactly():
    endpoint = RecordingEndpoint()
    state = constrained.run(schema=SCHEMA, backend=endpoint, temperature=0)
    letters, obj, count, free = endpoint.generated()
    assert letters == {"max_new_tokens": 8, "temperature": 0, "regex": LETTERS}
    assert obj == {"max_new_tokens": 32, "temperature": 0, "json_schema": json.dumps(SCHEMA)}
    assert count == {"max_new_tokens": 8, "temperature": 0, "regex": REGEX_INT, "stop": [" ", "\n"]}  # "default" template: no stop_str
    assert free == {"max_new_tokens": 4, "temperature": 0}
    assert state["count"] == "7"


def test_json_schema_as_dict_or_string_sends_the_same_body():
    as_dict, as_text, spaced = RecordingEndpoint(), RecordingEndpoint(), RecordingEndpoint()
    constrained.run(schema=SCHEMA, backend=as_dict)
    constrained.run(schema=json.dumps(SCHEMA), backend=as_text)
    assert as_dict.bodies == as_text.bodies
    text = json.dumps(SCHEMA, indent=2)  # a string goes unchanged: the server parses it
    constrained.run(schema=text, backend=spaced)
    assert spaced.generated()[1]["json_schema"] == text


def test_a_gen_constraint_replaces_the_run_default():
    endpoint = RecordingEndpoint()
    constrained.run(schema=SCHEMA, backend=endpoint, regex="[xyz]+")
    letters, obj, count, free = endpoint.generated()
    assert (letters["regex"], count["regex"], free["regex"]) == (LETTERS, REGEX_INT, "[xyz]+")
    assert "regex" not in obj and obj["json_schema"] == json.dumps(SCHEMA)
    endpoint = RecordingEndpoint()
    complete.run(backend=endpoint, json_schema=SCHEMA)  # a run-wide schema is serialized like a gen's
    assert endpoint.generated()[0]["json_schema"] == json.dumps(SCHEMA)


@rt.function
def branches(s, i: int) -> None:
    s += f"Item {i}: "
    forks = s.fork(3)
    forks += rt.gen("letters", regex=LETTERS, max_tokens=8)
    forks += lambda k: rt.gen("obj", json_schema=SCHEMA, max_tokens=32, temperature=k / 2)
    forks.join()


def test_forks_and_run_batch_keep_the_constraints():
    endpoint = RecordingEndpoint()
    states = branches.run_batch([{"i": i} for i in range(4)], backend=endpoint)
    assert all(s.error() is None and s["letters"] == ["7"] * 3 for s in states)
    sent = endpoint.generated()
    assert len(sent) == 4 * 3 * 2 and len(endpoint.bodies) == len(sent) + 4  # + one prefix request per fork
    assert sorted(p.get("regex", "") for p in sent) == [""] * 12 + [LETTERS] * 12
    assert sorted((p.get("json_schema"), p.get("temperature")) for p in sent if "regex" not in p) == sorted(
        (json.dumps(SCHEMA), k / 2) for k in range(3) for _ in range(4))
    prefix_only = [b["sampling_params"] for b in endpoint.bodies if b["sampling_params"].get("max_new_tokens") == 0]
    assert prefix_only == [{"max_new_tokens": 0}] * 4


# --- on the tiny random-weight server ---


@pytest.fixture(scope="module")
def constrained_backend(server: str) -> rt.RuntimeEndpoint:
    """The shared server."""
    return rt.RuntimeEndpoint(server)


@rt.function
def typed_record(s, i: int) -> None:
    s += f"Record {i}.\nLetters: " + rt.gen("letters", regex=LETTERS, max_tokens=8)
    s += "\nCount: " + rt.gen("count", dtype=int, max_tokens=8)
    s += "\nValid: " + rt.gen("valid", dtype=bool, max_tokens=8)
    s += "\nRatio: " + rt.gen("ratio", dtype=float, max_tokens=8)
    s += "\nWord: " + rt.gen("word", dtype=str, max_tokens=12)
    s += "\nJSON: " + rt.gen("obj", json_schema=SCHEMA, max_tokens=32)
    s += "\nColor: " + rt.gen("color", choices=COLORS)
    forks = s.fork(3)
    forks += "\nGuess: " + rt.gen("guess", dtype=int, max_tokens=8)
    forks += "\nTag: " + rt.gen("tag", regex=LETTERS, max_tokens=8)
    forks.join()


def valid_json(text: str) -> bool:
    try:
        jsonschema.validate(json.loads(text), SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


RULES = {"letters": LETTERS, "count": REGEX_INT, "valid": REGEX_BOOL, "ratio": REGEX_FLOAT, "word": REGEX_STR,
         "guess": REGEX_INT, "tag": LETTERS}
FORKED = ("guess", "tag")  # set in each of three branches: lists after the join
FINITE = ("letters", "valid", "tag")  # three letters, True/False: they end by themselves well within 8 tokens


def follows(name: str, value: str) -> bool:
    return valid_json(value) if name == "obj" else re.fullmatch(RULES[name], value) is not None


def outputs(state: rt.ProgramState, name: str) -> list[tuple[str, dict[str, Any]]]:
    """(value, meta_info) of a variable: one, or one per branch for a forked one."""
    value, meta = state[name], state.get_meta_info(name)
    return list(zip(value, meta)) if name in FORKED else [(value, meta)]


def check_record(state: rt.ProgramState) -> None:
    """Every value the model ended itself ("stop") follows its constraint; the finite ones always end."""
    for name in (*RULES, "obj"):
        pairs = outputs(state, name)
        assert len(pairs) == (3 if name in FORKED else 1)
        for value, meta in pairs:
            stopped = meta["finish_reason"]["type"] == "stop"
            assert stopped or name not in FINITE, (name, value, meta)
            assert not stopped or follows(name, value), (name, value, meta["finish_reason"])
    assert state["color"] in COLORS


@pytest.mark.parametrize("temperature", [0, 1.0])
def test_constrained_program_on_the_server(constrained_backend, temperature):
    state = typed_record.run(i=0, backend=constrained_backend, temperature=temperature)
    check_record(state)


def test_constrained_run_batch_on_the_server(constrained_backend):
    states = typed_record.run_batch([{"i": i} for i in range(4)], backend=constrained_backend, temperature=1.0)
    for state in states:
        assert state.error() is None, state.error()
        check_record(state)

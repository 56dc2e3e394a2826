"""Constrained decoding end to end: regexes and JSON schemas hold on a random-weight model.

Random weights are a good adversary: unconstrained, they never write a valid JSON object.
Every output that finished with stop must fully match its regex, or parse and validate with
`jsonschema`; every output cut by max_new_tokens must be a prefix its grammar accepts (a
fresh xgrammar matcher takes every output token). At least 80% finish with stop. Greedy and
sampled (three seeds), n=3, streamed, and under a pool a third of the need (retractions).
The shared server (conftest) runs with --constrained-json-disable-any-whitespace, as free
whitespace lets random weights pad JSON until max_new_tokens.
"""

from __future__ import annotations

import functools
import json
import re

import jsonschema
import pytest
import requests
from support.helpers import corpus_prompts, tokenizer
from transformers import GenerationConfig
from support.server_proc import assert_healthy_and_idle, running_server, server_info

REGEXES = [
    r"[a-z]{3}-\d{2}", r"(yes|no)", r"\d{1,4}(\.\d{1,2})?", r"[A-Z][a-z]{0,6}", r"#[0-9a-f]{6}",
    r"(cat|dog|bird)s?", r"\d{3}-\d{3}-\d{4}", r"[01]{8}", r"(true|false)", r"-?\d{1,3}",
    r"[a-z]+@[a-z]{1,5}\.(com|org)", r"\((\d,){0,2}\d\)", r"(ab|cd){1,3}", r"x{2,4}y?", r"[aeiou]{2}[a-z]",
    r"v\d\.\d\.\d", r"(north|south|east|west)", r"[A-Z]{2}\d{3}", r"\[\d{1,2}(, \d{1,2}){0,2}\]", r"(0|[1-9]\d{0,2})",
    r"(mon|tue|wed|thu|fri|sat|sun)day", r"\d{2}:\d{2}", r"[a-z]{1,4}( [a-z]{1,4}){0,2}\.", r"\$\d{1,3}\.\d{2}",
    r"(low|mid|high)-(low|mid|high)", r"[^a-z ]{1,5}", r"(https?)://[a-z]{2,6}\.io", r"<[a-z]{1,3}>", r"\d+%",
    r"(a|b)(c|d)(e|f)", r"[A-Za-z]{2}_[0-9]{2}",
]

_INT = {"type": "integer", "minimum": 0, "maximum": 99}
_SHORT = {"type": "string", "maxLength": 6}


def _obj(props: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": props, "required": required if required is not None else list(props),
            "additionalProperties": False}


SCHEMAS = [
    _obj({"n": _INT}), _obj({"ok": {"type": "boolean"}}), _obj({"name": _SHORT}),
    _obj({"n": _INT, "ok": {"type": "boolean"}}), _obj({"color": {"enum": ["red", "green", "blue"]}}),
    {"type": "array", "items": _INT, "minItems": 1, "maxItems": 3}, {"enum": ["a", "b", "c"]},
    _obj({"x": {"type": "number", "minimum": -5, "maximum": 5}}), {"type": "boolean"}, {"type": "null"},
    _obj({"inner": _obj({"v": _INT})}), _obj({"tags": {"type": "array", "items": _SHORT, "maxItems": 2}}),
    _obj({"id": {"type": "integer", "minimum": 1, "maximum": 9}, "label": {"type": "string", "pattern": "^[a-z]{1,4}$"}}),
    _obj({"a": _INT, "b": _INT, "c": _INT}), _obj({"kind": {"const": "point"}, "x": _INT}),
    {"type": "integer", "minimum": -50, "maximum": 50}, _obj({"when": {"type": "string", "pattern": "^\\d{2}:\\d{2}$"}}),
    _obj({"pair": {"type": "array", "items": _INT, "minItems": 2, "maxItems": 2}}),
    _obj({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    _obj({"choice": {"anyOf": [{"type": "boolean"}, {"enum": ["x", "y"]}]}}),
    _obj({"opt": _INT, "req": {"type": "boolean"}}, required=["req"]),
    {"type": "array", "items": {"enum": [1, 2, 3]}, "maxItems": 4}, _obj({"s": {"type": "string", "minLength": 1, "maxLength": 3}}),
    _obj({"nested": _obj({"deep": _obj({"ok": {"type": "boolean"}})})}),
    _obj({"pts": {"type": "array", "items": _obj({"x": _INT}), "maxItems": 2}}),
    _obj({"grade": {"enum": ["A", "B", "C", "D"]}, "score": _INT}), _obj({"f": {"type": "number", "minimum": 0, "maximum": 1}}),
    _obj({"code": {"type": "string", "pattern": "^[A-Z]{3}$"}}), {"type": "string", "maxLength": 8},
    _obj({"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}), _obj({"k": {"enum": [True, 0, "z"]}}),
    _obj({"e": {"type": "string", "enum": ["on", "off"]}, "n": {"type": "integer", "minimum": 10, "maximum": 20}}),
]
PROMPTS = ["Answer:", "The data follows.", "Here is the output", "Write it now"]


def _batch(server: str, kind: str, grammars: list[str], sampling: dict) -> list[dict]:
    items = [{kind: g, "max_new_tokens": 48, **sampling} for g in grammars]
    r = requests.post(server + "/generate", json={
        "text": [PROMPTS[i % len(PROMPTS)] for i in range(len(grammars))], "sampling_params": items}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


@functools.lru_cache(maxsize=2)
def _compiler(model):
    from radixrt.constrained.grammar import GrammarCompiler

    tok = tokenizer(model)
    eos = GenerationConfig.from_pretrained(model).eos_token_id  # the server's stop ids come from here
    return GrammarCompiler(tok, len(tok), sorted({tok.eos_token_id, *(eos if isinstance(eos, list) else [eos])}))


def _accepted_prefix(model, kind: str, grammar: str, ids: list[int]) -> bool:
    """A fresh matcher of the same grammar takes every output token (the stop token included)."""
    compiler = _compiler(model)
    matcher = compiler.matcher(compiler.compile(kind, grammar))
    return all(matcher.accept(t) for t in ids)


def _check(model, kind: str, grammars: list[str], results: list[dict]) -> float:
    """Every output valid; returns the fraction that finished with stop."""
    stopped = 0
    for g, res in zip(grammars, results):
        finish = res["meta_info"]["finish_reason"]
        assert finish["type"] in ("stop", "length"), (g, finish)
        if finish["type"] == "stop":
            stopped += 1
            if kind == "regex":
                assert re.fullmatch(g, res["text"]), (g, res["text"])
            else:
                # strict=False: xgrammar's JSON strings admit raw control characters (as in SGLang);
                # everything else about the document must be right
                jsonschema.validate(json.loads(res["text"], strict=False), json.loads(g))
        assert _accepted_prefix(model, kind, g, res["output_ids"]), (g, res["text"], finish)
    return stopped / len(grammars)


@pytest.mark.parametrize("sampling", [{"temperature": 0}] + [{"temperature": 1, "seed": s} for s in (1, 2, 3)],
                         ids=["greedy", "seed1", "seed2", "seed3"])
def test_regexes_and_schemas_hold(server, llama_path, sampling):
    schemas = [json.dumps(s) for s in SCHEMAS]
    assert len(REGEXES) >= 30 and len(schemas) >= 30
    regex_stop = _check(llama_path, "regex", REGEXES, _batch(server, "regex", REGEXES, sampling))
    schema_stop = _check(llama_path, "json_schema", schemas, _batch(server, "json_schema", schemas, sampling))
    assert regex_stop >= 0.8 and schema_stop >= 0.8, (regex_stop, schema_stop)
    assert_healthy_and_idle(server)


def test_n_samples_streaming_and_ebnf(server, llama_path):
    schema = json.dumps(SCHEMAS[3])
    r = requests.post(server + "/generate", json={"text": "Go", "sampling_params": {
        "json_schema": schema, "n": 3, "temperature": 1, "max_new_tokens": 48}}, timeout=120).json()
    assert len(r) == 3 and _check(llama_path, "json_schema", [schema] * 3, r) >= 2 / 3
    body = {"text": "Go", "stream": True, "sampling_params": {"regex": REGEXES[0], "temperature": 1, "max_new_tokens": 16}}
    with requests.post(server + "/generate", json=body, stream=True, timeout=120) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith(b"data: {")]
    assert len(events) >= 2 and events[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch(REGEXES[0], events[-1]["text"])
    ebnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | [0-9]'
    r = requests.post(server + "/generate", json={"text": "Go", "sampling_params": {"ebnf": ebnf, "max_new_tokens": 24}},
                      timeout=60).json()
    assert r["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert _accepted_prefix(llama_path, "ebnf", ebnf, r["output_ids"])
    if r["meta_info"]["finish_reason"]["type"] == "stop":
        assert re.fullmatch(r"\([a-c0-9](,[a-c0-9])*\)", r["text"]), r["text"]


def test_constraints_survive_retraction_and_jump_forward_saves_steps(server, llama_path):
    """A pool a third of what the batch needs: requests are retracted and recomputed, and
    their matchers carry on from the output they keep. Constrained requests alternate with
    unconstrained ones that run to max_new_tokens, so the pool runs short mid-decode.
    That server samples every token (--disable-jump-forward); the shared one jumps forward over
    a schema's long fixed keys, and takes fewer forward steps for the same valid output."""
    prompts = corpus_prompts(llama_path, [120, 160, 200, 140, 180, 100, 150, 170, 130, 190], seed=5)
    long_array = json.dumps({"type": "array", "items": _INT, "minItems": 8, "maxItems": 8})  # ~25 tokens of output
    items = [{"json_schema": long_array, "max_new_tokens": 48, "temperature": 1, "seed": i} if i % 2 == 0
             else {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0} for i in range(len(prompts))]
    need = sum(len(p) + it["max_new_tokens"] for p, it in zip(prompts, items))
    with running_server(llama_path, "--page-size", "4", "--max-total-tokens", str(need // 3), "--chunked-prefill-size",
                        "256", "--constrained-json-disable-any-whitespace", "--disable-jump-forward") as (url, _):
        r = requests.post(url + "/generate", json={"input_ids": prompts, "sampling_params": items}, timeout=300)
        assert r.status_code == 200, r.text
        constrained = r.json()[::2]
        assert _check(llama_path, "json_schema", [long_array] * len(constrained), constrained) >= 0.8
        assert server_info(url)["retractions"] > 0
        assert_healthy_and_idle(url)
        masked = _steps(url, LONG_KEYS)
        assert server_info(url)["jump_forward_tokens"] == 0
    jumped = _steps(server, LONG_KEYS)
    for run in (jumped, masked):
        assert run["finish"] == "stop", run
        jsonschema.validate(json.loads(run["text"], strict=False), json.loads(LONG_KEYS))
    assert server_info(server)["jump_forward_tokens"] > 0
    assert jumped["steps"] < masked["steps"], (jumped, masked)


LONG_KEYS = json.dumps(_obj({"customer_account_identifier": {"enum": [1, 2]}, "preferred_delivery_window": {"enum": [3, 4]},
                             "loyalty_programme_membership": {"type": "boolean"}}))


def _steps(url: str, schema: str) -> dict:
    """One greedy request under schema, alone on the server: its output and the forward steps it took."""
    before = server_info(url)["forward_steps"]
    r = requests.post(url + "/generate", json={"text": "Record:", "sampling_params": {
        "json_schema": schema, "max_new_tokens": 160, "temperature": 0}}, timeout=60).json()
    return {"text": r["text"], "finish": r["meta_info"]["finish_reason"]["type"],
            "steps": server_info(url)["forward_steps"] - before, "tokens": r["meta_info"]["completion_tokens"]}


# Enums and a short string: under the whitespace bound its longest output fits in 200 tokens.
BOUNDED = _obj({"city": {"enum": ["Paris", "Lima", "Oslo"]}, "mood": {"enum": ["calm", "busy"]},
                "code": {"type": "string", "maxLength": 4}, "ok": {"type": "boolean"}})


def test_bounded_whitespace_ends_every_seeded_run_in_json(model_paths):
    """The default whitespace bound (no whitespace flag): 30 seeded runs of the tiny qwen2 at
    temperature 1, in one batch, all end in valid JSON within 200 tokens (the longest took 102),
    no whitespace between JSON tokens running past the bound. With any whitespace allowed, 23 of
    the 30 pad with newlines until the budget ends."""
    import radixrt
    from radixrt.settings.constrained import JSON_MAX_WHITESPACE

    params = [{"temperature": 1, "seed": s, "max_new_tokens": 200, "json_schema": json.dumps(BOUNDED)} for s in range(30)]
    with radixrt.Engine(model_path=str(model_paths["qwen2"]), page_size=16, max_total_tokens=30 * 256 + 1024) as e:
        outs = e.generate(["Reply in JSON."] * 30, params)
    for o in outs:
        assert o["meta_info"]["finish_reason"]["type"] == "stop", o
        # strict=False: xgrammar lets a maxLength string hold raw control characters
        jsonschema.validate(json.loads(o["text"], strict=False), BOUNDED)
        between = re.sub(r'"(?:[^"\\]|\\.)*"', '""', o["text"])  # whitespace inside strings is content
        assert max(map(len, re.findall(r"\s+", between)), default=0) <= JSON_MAX_WHITESPACE, o["text"]

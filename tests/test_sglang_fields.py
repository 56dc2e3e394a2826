"""Every field of SGLang 0.5.9's request schemas is accepted with its default value.

The field lists and defaults are read with `ast` from SGLang's own source, the sglang 0.5.9
package installed in the venv (scripts/setup_env.sh; its srt/ files are there though only the
frontend imports without torch): GenerateReqInput (io_struct.py, with its base classes),
SamplingParams (sampling_params.py, its __init__ arguments) and the OpenAI CompletionRequest and
ChatCompletionRequest (openai/protocol.py). Each field, sent alone at SGLang's default, decodes
and passes validation; all of them at once go through the real server; each field this server
cannot honour is a 400 naming it for any other value; and the tables' defaults are SGLang's.
"""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import requests
import sglang  # setup_env.sh installs SGLang 0.5.9 (frontend and srt sources): missing, this fails

from radixrt.errors import RequestError
from radixrt.frontend import generate_input
from radixrt.frontend.generate_input import GenerateInput, GenerateRequest
from radixrt.sampling_params import UNSUPPORTED_FIELDS as SAMPLING_UNSUPPORTED
from radixrt.sampling_params import SamplingParams, SamplingParamsIn, refuse_unsupported
from radixrt.server import schemas
from radixrt.server.schemas import ChatCompletionRequest, CompletionRequest, decode_body

SRT = Path(sglang.__file__).parent / "srt"
# SGLang's default -> ours, where we deliberately differ: best_of 1 (OpenAI's default) asks for
# nothing either, and SGLang's None is accepted as empty.
TABLE_DEFAULT_EXCEPTIONS = {"best_of": 1}
MISSING = object()  # a required field (no default)


# -- reading SGLang's source -----------------------------------------------------------------

def _module(rel: str) -> ast.Module:
    return ast.parse((SRT / rel).read_text())


def _constants(tree: ast.Module) -> dict[str, Any]:
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:
                pass
    return out


def _value(node: ast.expr | None, consts: dict[str, Any]) -> Any:
    """A default as written: a literal, a module constant, or field(default=...) / Field(default=...)."""
    if node is None:
        return MISSING
    if isinstance(node, ast.Name) and node.id in consts:
        return consts[node.id]
    if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("field", "Field"):
        kw = {k.arg: k.value for k in node.keywords}
        if "default_factory" in kw:
            return {"list": [], "dict": {}}[kw["default_factory"].id]
        return _value(kw.get("default"), consts)
    return ast.literal_eval(node)


def class_fields(rel: str, *names: str) -> dict[str, Any]:
    """Annotated class attributes (dataclass / pydantic fields) of the named classes, with defaults."""
    tree = _module(rel)
    consts = _constants(tree)
    out: dict[str, Any] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in names):
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and not stmt.target.id.startswith("_"):
                out[stmt.target.id] = _value(stmt.value, consts)
    return out


def init_args(rel: str, cls_name: str) -> dict[str, Any]:
    """The keyword arguments of a class's __init__, with defaults."""
    tree = _module(rel)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls_name)
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    args = init.args.args[1:]
    defaults = [None] * (len(args) - len(init.args.defaults)) + list(init.args.defaults)
    return {a.arg: _value(d, {}) for a, d in zip(args, defaults)}


GENERATE = class_fields("managers/io_struct.py", "GenerateReqInput", "BaseReq", "APIServingTimingMixin")
SAMPLING = init_args("sampling/sampling_params.py", "SamplingParams")
COMPLETION = class_fields("entrypoints/openai/protocol.py", "CompletionRequest")
CHAT = class_fields("entrypoints/openai/protocol.py", "ChatCompletionRequest")


def test_the_source_read_is_sglang_0_5_9_and_complete():
    assert sglang.__version__ == "0.5.9"
    # spot checks that the reader found the fields (and their defaults) the issue names
    assert GENERATE["return_routed_experts"] is False and GENERATE["return_hidden_states"] is False
    assert GENERATE["rid"] is None and GENERATE["extra_key"] is None and "received_time" in GENERATE
    assert SAMPLING["max_new_tokens"] == 128 and SAMPLING["sampling_seed"] is None and len(SAMPLING) == 25
    assert CHAT["continue_final_message"] is False and CHAT["reasoning_effort"] == "medium"
    assert CHAT["messages"] is MISSING and COMPLETION["prompt"] is MISSING and COMPLETION["max_tokens"] == 16
    assert CHAT["tool_choice"] == "auto" and COMPLETION["model"] == "default"
    assert (len(GENERATE), len(COMPLETION), len(CHAT)) == (50, 47, 53)


# -- each field alone, at SGLang's default ---------------------------------------------------

BASE_GENERATE = {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
BASE_COMPLETION = {"prompt": "hi", "max_tokens": 1}
BASE_CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 1}


def _with(base: dict[str, Any], fields: dict[str, Any], name: str) -> dict[str, Any]:
    return base if name in base or fields[name] is MISSING else {**base, name: fields[name]}


@pytest.mark.parametrize("name", sorted(GENERATE))
def test_generate_accepts_the_field_at_sglangs_default(name):
    raw = json.dumps(_with(BASE_GENERATE, GENERATE, name)).encode()
    assert GenerateInput.from_request(decode_body(raw, GenerateRequest)).items


@pytest.mark.parametrize("name", sorted(SAMPLING))
def test_sampling_params_accept_the_field_at_sglangs_default(name):
    params = SamplingParams.from_dict({"max_new_tokens": 1, name: SAMPLING[name]} if name != "max_new_tokens"
                                      else {name: SAMPLING[name]})
    assert params.max_new_tokens == (128 if name == "max_new_tokens" else 1)


@pytest.mark.parametrize("kind,fields,base,table", [
    (CompletionRequest, COMPLETION, BASE_COMPLETION, schemas.COMPLETION_UNSUPPORTED),
    (ChatCompletionRequest, CHAT, BASE_CHAT, schemas.CHAT_UNSUPPORTED),
], ids=["completions", "chat"])
def test_openai_requests_accept_every_field_at_sglangs_default(kind, fields, base, table):
    for name in fields:
        body = decode_body(json.dumps(_with(base, fields, name)).encode(), kind)
        refuse_unsupported(body, table)  # what the route checks first


# -- the tables: SGLang's defaults, and a 400 naming the field for anything else ----------------

TABLES = [
    ("generate", generate_input.UNSUPPORTED_FIELDS, generate_input.IGNORED_FIELDS, GenerateRequest, GENERATE),
    ("sampling", SAMPLING_UNSUPPORTED, {}, SamplingParamsIn, SAMPLING),
    ("completion", schemas.COMPLETION_UNSUPPORTED, schemas.COMPLETION_IGNORED, CompletionRequest, COMPLETION),
    ("chat", schemas.CHAT_UNSUPPORTED, schemas.CHAT_IGNORED, ChatCompletionRequest, CHAT),
]


@pytest.mark.parametrize("label,unsupported,ignored,kind,fields", TABLES, ids=[t[0] for t in TABLES])
def test_tables_hold_sglang_fields_with_sglangs_defaults(label, unsupported, ignored, kind, fields):
    assert not set(unsupported) & set(ignored)
    for name, default in unsupported.items():
        assert name in fields, f"{name} is not an SGLang {label} field"
        assert default == TABLE_DEFAULT_EXCEPTIONS.get(name, fields[name]), name
    assert set(ignored) <= set(fields)
    ours = {f.name for f in msgspec.structs.fields(kind)}
    assert set(fields) <= ours, f"SGLang {label} fields we lack: {sorted(set(fields) - ours)}"


def _asking_value(default: Any) -> Any:
    """A value that asks for something (not the default, not empty)."""
    return {False: True, 0: 7, 1: 2}.get(default, "x") if default is not None else "x"


@pytest.mark.parametrize("table,kind,base", [
    (generate_input.UNSUPPORTED_FIELDS, GenerateRequest, BASE_GENERATE),
    (schemas.COMPLETION_UNSUPPORTED, CompletionRequest, BASE_COMPLETION),
    (schemas.CHAT_UNSUPPORTED, ChatCompletionRequest, BASE_CHAT),
], ids=["generate", "completion", "chat"])
def test_an_unsupported_field_that_asks_for_something_is_refused_by_name(table, kind, base):
    for name, default in table.items():
        body = decode_body(json.dumps({**base, name: _asking_value(default)}).encode(), kind)
        with pytest.raises(RequestError) as e:
            GenerateInput.from_request(body) if kind is GenerateRequest else refuse_unsupported(body, table)
        assert e.value.param == name and name in e.value.message
    for name in SAMPLING_UNSUPPORTED:
        with pytest.raises(RequestError, match=f"sampling_params.{name}"):
            SamplingParams.from_dict({name: "x"})


# -- all of them at once, through the server -------------------------------------------------

def _all_defaults(fields: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    return {**{k: v for k, v in fields.items() if v is not MISSING}, **base}


def test_the_server_takes_every_field_at_sglangs_default_at_once(server):
    sampling = {**SAMPLING, "max_new_tokens": 2}
    bodies = [
        ("/generate", _all_defaults(GENERATE, {"text": "hi", "sampling_params": sampling})),
        ("/v1/completions", _all_defaults(COMPLETION, {**BASE_COMPLETION, "max_tokens": 2})),
        ("/v1/chat/completions", _all_defaults(CHAT, {**BASE_CHAT, "max_completion_tokens": 2})),
    ]
    for path, body in bodies:
        r = requests.post(server + path, json=body, timeout=60)
        assert r.status_code == 200, (path, r.text)
    r = requests.post(server + "/generate", json={**bodies[0][1], "return_hidden_states": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_hidden_states"


# -- update_weights_from_disk ------------------------------------------------------------------

UPDATE = class_fields("managers/io_struct.py", "UpdateWeightFromDiskReqInput", "BaseReq")


def test_the_weight_update_body_takes_every_sglang_field_and_refuses_what_it_cannot_honour():
    from radixrt.frontend.weights import IGNORED_UPDATE_OPTIONS, UNSUPPORTED_UPDATE_OPTIONS, check_update_options
    from radixrt.server.schemas import UPDATE_CALL_FIELDS, UpdateWeightsBody

    assert UPDATE["flush_cache"] is True and UPDATE["model_path"] is MISSING and len(UPDATE) == 13
    assert set(UpdateWeightsBody.__struct_fields__) == set(UPDATE)
    body = decode_body(json.dumps(_all_defaults(UPDATE, {"model_path": "m"})).encode(), UpdateWeightsBody)
    options = {f: getattr(body, f) for f in body.__struct_fields__ if f not in UPDATE_CALL_FIELDS}
    check_update_options(**options)  # SGLang's defaults pass
    assert set(options) == {"load_format", *UNSUPPORTED_UPDATE_OPTIONS, *IGNORED_UPDATE_OPTIONS}
    for name, default in UNSUPPORTED_UPDATE_OPTIONS.items():
        assert UPDATE[name] == default, name
        with pytest.raises(RequestError) as e:
            check_update_options(**{**options, name: _asking_value(default)})
        assert e.value.param == name


# -- the prefill-only routes: /encode, /v1/embeddings, /v1/score, /v1/rerank --------------------

ENCODE = class_fields("managers/io_struct.py", "EmbeddingReqInput", "BaseReq", "APIServingTimingMixin")
EMBEDDING = class_fields("entrypoints/openai/protocol.py", "EmbeddingRequest")
SCORE = class_fields("entrypoints/openai/protocol.py", "ScoringRequest")
RERANK = class_fields("entrypoints/openai/protocol.py", "V1RerankReqInput")
READOUT_BODIES = [  # (SGLang's fields, our struct, the route, a body that asks for something)
    (ENCODE, "EncodeRequest", "/encode", {"text": "hi"}),
    (EMBEDDING, "EmbeddingRequest", "/v1/embeddings", {"input": "hi"}),
    (SCORE, "ScoringRequest", "/v1/score", {"query": "hi", "items": [" there"], "label_token_ids": [1]}),
    (RERANK, "RerankRequest", "/v1/rerank", {"query": "hi", "documents": ["there"]}),
]


def test_the_prefill_only_structs_read_are_sglangs():
    assert ENCODE["dimensions"] is None and ENCODE["is_cross_encoder_request"] is False and "received_time" in ENCODE
    assert EMBEDDING["input"] is MISSING and EMBEDDING["encoding_format"] == "float"
    assert SCORE["apply_softmax"] is False and SCORE["item_first"] is False and "label_token_ids" in SCORE
    assert RERANK["query"] is MISSING and RERANK["return_documents"] is True and RERANK["top_n"] is None
    assert (len(ENCODE), len(EMBEDDING), len(SCORE), len(RERANK)) == (22, 8, 6, 5)


@pytest.mark.parametrize("fields,kind,path,base", READOUT_BODIES, ids=[b[2] for b in READOUT_BODIES])
def test_the_prefill_only_routes_take_every_sglang_field_at_its_default(server, fields, kind, path, base):
    from radixrt.server import readout_schemas

    struct = getattr(readout_schemas, kind)
    assert set(fields) <= {f.name for f in msgspec.structs.fields(struct)}, sorted(set(fields) - set(struct.__struct_fields__))
    for name in fields:  # each alone
        decode_body(json.dumps(_with(base, fields, name)).encode(), struct)
    for name, default in readout_schemas.ENCODE_UNSUPPORTED.items() if path == "/encode" else ():
        assert ENCODE[name] == default, name
    body = _all_defaults(fields, base)
    status = 400 if path == "/v1/rerank" else 200  # the session's model is no reranker: refused by name, not by field
    r = requests.post(server + path, json=body, timeout=60)
    assert r.status_code == status, (path, r.text)
    assert status == 200 or "cannot rerank" in r.json()["error"]["message"]

"""response_format on /v1/chat/completions and /v1/completions, through the official openai client:
json_schema and json_object outputs parse (and match the schema), a wrong response_format is a
400 naming it, and the server serves on after one."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest
import requests

# Small and bounded, so a stop-finished answer fits well within MAX_TOKENS.
SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "pick", "schema": SCHEMA, "strict": True}}
MAX_TOKENS = 48
MESSAGES = [{"role": "user", "content": "Answer in JSON: a digit n and a flag ok."}]
PROMPT = "Answer in JSON with a digit n and a flag ok:"
ENDPOINTS = ("chat", "completions")


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def create(client: openai.OpenAI, model: str, endpoint: str, response_format: dict[str, Any],
           **kw: Any) -> list[tuple[str, str]]:
    """(finish_reason, text) of each choice."""
    if endpoint == "chat":
        r = client.chat.completions.create(model=model, messages=MESSAGES, response_format=response_format,
                                           max_tokens=MAX_TOKENS, **kw)
        return [(c.finish_reason, c.message.content) for c in r.choices]
    # the client's completions.create has no response_format argument: it goes in the body as is
    extra = {**kw.pop("extra_body", {}), "response_format": response_format}
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, extra_body=extra, **kw)
    return [(c.finish_reason, c.text) for c in r.choices]


def greedy_and_sampled(client: openai.OpenAI, model: str, endpoint: str,
                       response_format: dict[str, Any]) -> list[tuple[str, str]]:
    return (create(client, model, endpoint, response_format, temperature=0)
            + create(client, model, endpoint, response_format, temperature=1, n=6, seed=11))


def assert_object_prefix(finish: str, text: str) -> None:
    """A choice cut by max_tokens: all we can say is that it began an object."""
    assert finish == "length", (finish, text)
    assert text.lstrip()[:1] in ("{", ""), text


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_json_schema_output_matches_the_schema(client, model, endpoint):
    choices = greedy_and_sampled(client, model, endpoint, JSON_SCHEMA_FORMAT)
    matched = 0
    for finish, text in choices:
        if finish != "stop":
            assert_object_prefix(finish, text)
            continue
        jsonschema.validate(json.loads(text), SCHEMA)
        matched += 1
    assert matched, f"no choice finished with stop within {MAX_TOKENS} tokens: {choices}"


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_json_object_output_is_an_object(client, model, endpoint):
    for finish, text in greedy_and_sampled(client, model, endpoint, {"type": "json_object"}):
        if finish == "stop":
            assert isinstance(json.loads(text), dict), text
        else:
            assert_object_prefix(finish, text)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_text_format_is_unconstrained(client, model, endpoint):
    [(finish, _)] = create(client, model, endpoint, {"type": "text"}, temperature=0)
    assert finish in ("stop", "length")


BAD_FORMATS = [
    ({"type": "xml"}, {}, "'xml'"),
    ({"type": "json_schema"}, {}, "json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "pick"}}, {}, "json_schema.schema"),
    ({"type": "json_object"}, {"regex": "[a-z]+"}, "regex"),
    (JSON_SCHEMA_FORMAT, {"ebnf": 'root ::= "a"'}, "ebnf"),
]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("response_format,extra,words", BAD_FORMATS, ids=[w for _, _, w in BAD_FORMATS])
def test_a_bad_response_format_is_a_400_naming_it_and_the_server_serves_on(server, client, model, endpoint,
                                                                            response_format, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        create(client, model, endpoint, response_format, temperature=0, extra_body=extra)
    assert e.value.param == "response_format" and words in e.value.body["message"], e.value.body
    assert requests.get(server + "/health", timeout=30).status_code == 200
    [(finish, _)] = create(client, model, "completions", {"type": "text"}, temperature=0)
    assert finish in ("stop", "length")


def test_openapi_describes_response_format(server):
    schemas = requests.get(server + "/openapi.json", timeout=30).json()["components"]["schemas"]
    assert schemas["ResponseFormat"]["properties"]["type"]["enum"] == ["text", "json_object", "json_schema"]
    assert set(schemas["JsonSchemaFormat"]["properties"]) == {"name", "schema", "description", "strict"}
    for body in ("ChatCompletionRequest", "CompletionRequest"):
        assert "response_format" in schemas[body]["properties"]

"""Pins with a TTL, the request side (issue 33 #3): `cache_control` ({"type": "ephemeral",
"ttl": ...}, Anthropic's shape) on /generate, the Engine and the OpenAI routes is resolved at
the door into TokenizedRequest.pin_ttl (seconds) and reaches the scheduler's Req; a type other
than "ephemeral" or a ttl that is not a duration in (0, 24h] is a 400 naming cache_control."""

from __future__ import annotations

import json

import pytest
from support.http import post

from radixrt.errors import RequestError
from radixrt.frontend.generate_input import GenerateInput, GenerateRequest
from radixrt.frontend.intake import PreparedReq
from radixrt.messages import TokenizedRequest
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.bad_input import request_problem
from radixrt.scheduler.req import Req
from radixrt.server.openai_api import native_request
from radixrt.server.schemas import ChatCompletionRequest, CompletionRequest, decode_body

TTLS = [  # ttl as sent -> seconds
    (None, 300.0),  # Anthropic's default, 5 minutes
    ("5m", 300.0), ("1h", 3600.0), ("30s", 30.0), ("90m", 5400.0), ("1.5h", 5400.0), ("24h", 86400.0),
    (45, 45.0), (0.5, 0.5), (86400, 86400.0),
]
BAD_TTLS = ["2d", "5 m", "5M", "-5m", "m", "", "0s", "25h", 0, -1, 86401, 1e9, True, [5], {"m": 5}]


def tokenized(gen: GenerateInput) -> list[TokenizedRequest]:
    """What the door sends the scheduler for each item (the Intake's message, prompt ids as given)."""
    return [PreparedReq(it.input_ids or [1, 2, 3], it, -1).message(f"r{i}") for i, it in enumerate(gen.items)]


def native(body: dict) -> GenerateInput:
    return GenerateInput.from_request(decode_body(json.dumps({"input_ids": [1, 2, 3], **body}).encode(), GenerateRequest))


def openai(kind: type, body: dict) -> GenerateInput:
    """The OpenAI route's conversion: decode, then the native request it makes (chat ids stand in for the template)."""
    base = {"prompt": [1, 2, 3]} if kind is CompletionRequest else {"messages": [{"role": "user", "content": "hi"}]}
    req = decode_body(json.dumps({**base, **body}).encode(), kind)
    return GenerateInput.from_request(native_request(req, input_ids=[1, 2, 3]))


ROUTES = {
    "generate": native,
    "completions": lambda body: openai(CompletionRequest, body),
    "chat": lambda body: openai(ChatCompletionRequest, body),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("ttl,seconds", TTLS, ids=[repr(t) for t, _ in TTLS])
def test_the_ttl_reaches_the_scheduler_in_seconds(route, ttl, seconds):
    cc = {"type": "ephemeral"} if ttl is None else {"type": "ephemeral", "ttl": ttl}
    (msg,) = tokenized(ROUTES[route]({"cache_control": cc}))
    assert msg.pin_ttl == seconds
    assert Req.from_msg(msg).pin_ttl == seconds
    assert request_problem(msg, 50, 4096) is None


@pytest.mark.parametrize("route", ROUTES)
def test_no_cache_control_is_no_pin(route):
    for body in ({}, {"cache_control": None}):
        (msg,) = tokenized(ROUTES[route](body))
        assert msg.pin_ttl is None and Req.from_msg(msg).pin_ttl is None


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("cc", [{"type": "persistent"}, {"type": "Ephemeral", "ttl": "5m"}, {"ttl": "5m"},
                                {"type": "ephemeral", "scope": "global"}, "ephemeral", {"type": None}]
                         + [{"type": "ephemeral", "ttl": t} for t in BAD_TTLS])
def test_anything_else_is_a_400_naming_cache_control(route, cc):
    with pytest.raises(RequestError) as e:
        ROUTES[route]({"cache_control": cc})
    assert e.value.status == 400 and e.value.param.startswith("cache_control"), (e.value.param, e.value.message)
    assert "cache_control" in e.value.message


def test_the_400_says_what_is_accepted():
    with pytest.raises(RequestError, match=r'cache_control.type must be "ephemeral", got .persistent.'):
        native({"cache_control": {"type": "persistent"}})
    with pytest.raises(RequestError, match=r'cache_control.ttl must be "5m", "1h", "<N>s", "<N>m", "<N>h" or a number '
                                           r"of seconds, above 0 and at most 24h, got '2d'"):
        native({"cache_control": {"type": "ephemeral", "ttl": "2d"}})


def test_a_native_call_pins_per_prompt_and_every_parallel_sample():
    gen = native({"input_ids": [[1, 2], [3, 4]], "sampling_params": {"n": 2},
                  "cache_control": [{"type": "ephemeral", "ttl": "1h"}, None]})
    assert [m.pin_ttl for m in tokenized(gen)] == [3600.0, 3600.0, None, None]
    shared = native({"input_ids": [[1, 2], [3, 4]], "cache_control": {"type": "ephemeral"}})
    assert [m.pin_ttl for m in tokenized(shared)] == [300.0, 300.0]
    with pytest.raises(RequestError) as e:
        native({"input_ids": [[1, 2], [3, 4]], "cache_control": [{"type": "ephemeral"}]})
    assert e.value.param == "cache_control"


def test_the_engine_takes_it_as_a_dict():
    gen = GenerateInput.build(input_ids=[1, 2], cache_control={"type": "ephemeral", "ttl": "10m"})  # as Engine._input
    assert [m.pin_ttl for m in tokenized(gen)] == [600.0]
    with pytest.raises(RequestError) as e:
        GenerateInput.build(input_ids=[1, 2], cache_control={"type": "ephemeral", "ttl": float("inf")})
    assert e.value.param == "cache_control"


def test_the_scheduler_refuses_a_pin_the_door_would_not_make():
    for bad in (0.0, -1.0, 86401.0, float("nan")):
        why = request_problem(TokenizedRequest("r", [1, 2], SamplingParams(max_new_tokens=1), pin_ttl=bad), 50, 4096)
        assert why is not None and why.startswith("cache_control"), (bad, why)


def test_every_route_takes_the_field_and_refuses_a_bad_one_by_name(server):
    bodies = {
        "/generate": {"text": "pin me", "sampling_params": {"max_new_tokens": 1}},
        "/v1/completions": {"prompt": "pin me", "max_tokens": 1},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "pin me"}], "max_tokens": 1},
    }
    for path, body in bodies.items():
        ok = post(server, path, {**body, "cache_control": {"type": "ephemeral", "ttl": "5m"}})
        assert ok.status_code == 200, (path, ok.text)
        bad = post(server, path, {**body, "cache_control": {"type": "ephemeral", "ttl": "1w"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_control", (path, bad.text)

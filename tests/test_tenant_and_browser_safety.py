"""Issue 29 (part two), #5, #7, #10: no tenant reads another's cache or learns what it holds; no
web page reaches the server through a visitor's browser; the open routes are no load source. Each
case ends with the server healthy, an unrelated request served, and no KV page or rid leaked."""

from __future__ import annotations

import json
import logging
import socket
import statistics
import threading
import time
import urllib.request
from random import Random

import pytest
import requests
from support.helpers import wait_for
from support.server_proc import assert_healthy_and_idle, running_server, server_info

from radixrt.config import ServerArgs
from radixrt.config_views import HttpConfig
from radixrt.frontend.generate_input import cache_namespace
from radixrt.launch_server import warn_about_keys
from radixrt.namespace import CacheNamespace
from radixrt.server.access import cache_report_scope

MAX_CONNECTIONS = 100
ARGS = ("--max-total-tokens", "4096", "--max-connections", str(MAX_CONNECTIONS), "--allowed-hosts", "tenant.example")
JSON = {"Content-Type": "application/json"}
FLOOD_CLIENTS = 32


@pytest.fixture(scope="module")
def server(llama_path):
    with running_server(llama_path, *ARGS) as (url, _):
        yield url


def ids(seed: int, n: int = 160) -> list[int]:
    rng = Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def generate(url: str, prompt: list[int], **fields) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1, "temperature": 0}, **fields}
    r = requests.post(url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def served(url: str) -> None:
    """An unrelated request is answered."""
    assert generate(url, ids(99, 8))["meta_info"]["completion_tokens"] == 1


# -- #5 tenant isolation -------------------------------------------------------------------------


def test_a_salt_and_an_extra_key_never_spell_another_salt():
    names = [cache_namespace(s, k) for s, k in [("tenant", "A"), ("tenantA", None), ("tenant", None), (None, "A"),
                                                ("[x", None), ('["tenant", "A"]', None), ("ten", "antA"), ("[", "x")]]
    assert len(set(names)) == len(names) and names[1] == CacheNamespace(salt="tenantA")
    assert len({n.encoded for n in names}) == len(names)  # the tiers' content keys keep them apart too
    assert cache_namespace(None, "A") == cache_namespace("A", None) == CacheNamespace(salt="A")  # SGLang: itself
    assert cache_namespace(None, None) == CacheNamespace() and cache_namespace("", "") == CacheNamespace()


def test_a_tenant_reads_no_other_namespace_through_extra_key(server):
    prompt = ids(1)
    assert generate(server, prompt, cache_salt="tenantA")["meta_info"]["cached_tokens"] == 0
    assert generate(server, prompt, cache_salt="tenantA")["meta_info"]["cached_tokens"] == len(prompt) - 1
    probe = generate(server, prompt, cache_salt="tenant", extra_key="A")["meta_info"]["cached_tokens"]
    openai = requests.post(server + "/v1/completions", json={"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant",
                                                             "extra_key": "A"}, timeout=60).json()
    served(server)
    assert probe == 0, f"salt 'tenant' + extra_key 'A' read {probe} tokens of salt 'tenantA'"
    assert openai["usage"]["prompt_tokens_details"]["cached_tokens"] == len(prompt) - 1  # its own namespace, warm now
    assert_healthy_and_idle(server)


def _report(url: str, **params) -> dict:
    r = requests.get(url + "/cache_report", params=params, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def _low_repetition(url: str) -> int:
    """How many recent prompts /metrics counts as low repetition (the gauge is a share of them)."""
    lines = requests.get(url + "/metrics", timeout=10).text.splitlines()
    value = {line.split(" ")[0]: float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith("radixrt:cache_")}
    return round(value['radixrt:cache_cause_share{kind="low_repetition"}'] * value["radixrt:cache_report_prompts"])


def test_a_guess_tells_nothing_about_another_tenants_prompts(server):
    secret, wrong = ids(2), ids(3)
    generate(server, secret, cache_salt="victim")
    low = _low_repetition(server)
    generate(server, secret, cache_salt="guesser-1")  # the right guess
    right_moves = _low_repetition(server) - low
    generate(server, wrong, cache_salt="guesser-2")  # a wrong one
    wrong_moves = _low_repetition(server) - low - right_moves
    right, wrong_report = _report(server, cache_salt="guesser-1"), _report(server, cache_salt="guesser-2")
    served(server)
    assert right_moves == wrong_moves == 1, "/metrics moved differently for a right and a wrong guess"
    assert right == wrong_report, "/cache_report told a right guess from a wrong one"
    assert right["scope"] == "namespace" and right["prompts"] == 1 and right["shared_token_rate"] == 0.0
    assert _report(server, cache_salt="victim")["prompts"] == 1
    unsalted = _report(server)  # no key here, so no admin: only requests without salt or extra_key (served's)
    assert unsalted["scope"] == "namespace" and unsalted["prompt_tokens"] == 8 * unsalted["prompts"] > 0
    assert requests.get(server + "/cache_report", params={"cache_salt": "x" * 5000}, timeout=10).json()[
        "error"]["param"] == "cache_salt"
    assert_healthy_and_idle(server)


def test_only_the_admin_key_reads_every_namespace():
    keyed = HttpConfig.of(ServerArgs(model_path="m", api_key="user", admin_api_key="boss"))
    assert cache_report_scope(keyed, "Bearer boss", None, None) is None  # every namespace
    assert cache_report_scope(keyed, "Bearer boss", "s", None) == CacheNamespace(salt="s")
    assert cache_report_scope(keyed, "Bearer user", None, None) == CacheNamespace()
    assert cache_report_scope(keyed, "Bearer user", "ten", "ant") == CacheNamespace(salt="ten", extra_key="ant")
    only_api = HttpConfig.of(ServerArgs(model_path="m", api_key="user"))
    assert cache_report_scope(only_api, "Bearer user", None, None) is None  # api_key is the admin key then
    assert cache_report_scope(ServerArgs(model_path="m"), None, None, None) == CacheNamespace()  # no key, no admin


# -- #7 browsers ---------------------------------------------------------------------------------


def test_a_web_page_cannot_reach_the_admin_routes(server, llama_path):
    update = json.dumps({"model_path": str(llama_path)})
    forged = requests.post(server + "/update_weights_from_disk", data=update, timeout=60,
                           headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
    as_text = requests.post(server + "/update_weights_from_disk", data=update, timeout=60,
                            headers={"Content-Type": "text/plain"})
    bodiless_forged = requests.post(server + "/flush_cache", headers={"Origin": "http://evil.example"}, timeout=10)
    cross_site = requests.post(server + "/abort_request", json={"abort_all": True}, timeout=10,
                               headers={"Sec-Fetch-Site": "cross-site"})
    img = requests.get(server + "/flush_cache", timeout=10)
    served(server)
    assert (forged.status_code, forged.json()["error"]["param"]) == (403, "Origin"), forged.text
    assert (as_text.status_code, as_text.json()["error"]["param"]) == (415, "Content-Type"), as_text.text
    assert "application/json" in as_text.json()["error"]["message"]
    assert bodiless_forged.status_code == 403 and cross_site.status_code == 403
    assert img.status_code == 405 and "POST" in img.json()["error"]["message"]
    assert_healthy_and_idle(server)


def test_a_rebinding_page_is_refused_and_real_clients_are_not(server):
    port = server.rsplit(":", 1)[1]
    rebound = requests.get(server + "/get_server_info", headers={"Host": f"evil.example:{port}"}, timeout=10)
    rebound_flush = requests.post(server + "/flush_cache", headers={"Host": "evil.example"}, timeout=10)
    assert rebound.status_code == 400 and "--allowed-hosts" in rebound.json()["error"]["message"]
    assert rebound_flush.status_code == 400
    assert requests.get(server + "/health", headers={"Host": "evil.example"}, timeout=10).status_code == 200  # open
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "tenant.example:8443", "[::1]"):
        assert requests.get(server + "/get_model_info", headers={"Host": host}, timeout=10).status_code == 200, host
    # what SGLang's clients, radixrt.lang and sglang-router send
    assert requests.post(server + "/flush_cache", timeout=30).status_code == 200  # bodiless, no Content-Type
    sglang_style = urllib.request.Request(server + "/flush_cache", method="POST",
                                          headers={"Content-Type": "application/json; charset=utf-8"})
    with urllib.request.urlopen(sglang_style, timeout=30) as r:
        assert r.status == 200
    same_origin = requests.post(server + "/generate", timeout=60, headers={**JSON, "Origin": f"http://127.0.0.1:{port}"},
                                json={"text": "hi", "sampling_params": {"max_new_tokens": 1}})
    assert same_origin.status_code == 200, same_origin.text
    import radixrt

    radixrt.RuntimeEndpoint(server).flush_cache()
    served(server)
    assert_healthy_and_idle(server)


def test_only_an_api_key_warns_that_api_users_reach_admin_routes(caplog):
    with caplog.at_level(logging.WARNING, logger="radixrt.server"):
        warn_about_keys(ServerArgs(model_path="m", api_key="k"))
        warn_about_keys(ServerArgs(model_path="m", api_key="k", admin_api_key="a"))
        warn_about_keys(ServerArgs(model_path="m"))
    assert len(caplog.records) == 1 and "--admin-api-key" in caplog.records[0].getMessage()


# -- #10 open routes as a load source ------------------------------------------------------------


def _timed_generate(url: str) -> float:
    t = time.perf_counter()
    generate(url, ids(7, 16), sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    return time.perf_counter() - t


def test_health_generate_is_single_flight_and_cached(server):
    baseline = statistics.median(_timed_generate(server) for _ in range(3))
    tokens_before, stop, statuses = server_info(server)["prompt_tokens"], threading.Event(), []

    def loop() -> None:
        with requests.Session() as s:
            while not stop.is_set():
                statuses.append(s.get(server + "/health_generate", timeout=30).status_code)

    threads = [threading.Thread(target=loop) for _ in range(FLOOD_CLIENTS)]
    start = time.monotonic()
    for t in threads:
        t.start()
    flooded = statistics.median(_timed_generate(server) for _ in range(3))
    stop.set()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - start
    probes = server_info(server)["prompt_tokens"] - tokens_before - 3 * 16  # a probe's prompt is 1 token
    print(f"{len(statuses)} probe calls in {elapsed:.1f} s ran {probes} probes; /generate median "
          f"{baseline * 1000:.0f} ms alone, {flooded * 1000:.0f} ms beside {FLOOD_CLIENTS} probing clients")
    assert set(statuses) == {200} and len(statuses) >= FLOOD_CLIENTS
    assert probes <= elapsed + 2, f"{probes} probe generations for {len(statuses)} calls in {elapsed:.1f} s"
    assert_healthy_and_idle(server)


def test_health_answers_at_the_connection_limit(server):
    port = int(server.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(MAX_CONNECTIONS + 10)]
    try:
        wait_for(lambda: requests.get(server + "/get_model_info", timeout=5).status_code, lambda s: s == 503)
        health = requests.get(server + "/health", timeout=5)
    finally:
        for s in idle:
            s.close()
    assert health.status_code == 200, "/health answered 503 at the connection limit"
    wait_for(lambda: requests.get(server + "/get_model_info", timeout=5).status_code, lambda s: s == 200)
    served(server)
    assert_healthy_and_idle(server)

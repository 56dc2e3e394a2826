"""Tenants through a real server (issue 36): API keys from --api-keys-file name tenants; admission
shares the running slots among tenants by weight (tenant B's one request, sent after tenant A's
200, finishes before 150 of A's do, by order); a tenant's KV quota keeps another tenant's flood
from evicting its cached prefix; the figures come per tenant in /metrics and /cache_report; a
priority on a server without priorities gets SGLang's 503 with --abort-on-priority-when-disabled."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from support.helpers import assert_pool_idle, corpus_prompts, wait_for, wait_idle
from support.http import metrics
from support.server_proc import running_server

KEYS = {"key-a": {"tenant": "a"}, "key-b": {"tenant": "b", "weight": 1.0, "kv_quota": 0.5},
        "key-c": {"tenant": "c", "share_cache": True}}
POOL = 6144  # tokens (page size 1): A's flood below overflows it several times
A, B = {"Authorization": "Bearer key-a"}, {"Authorization": "Bearer key-b"}


@pytest.fixture(scope="module")
def server(llama_path, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with running_server(llama_path, "--api-keys-file", str(keys), "--max-running-requests", "4",
                        "--tenant-kv-quota", "0.4", "--max-total-tokens", str(POOL),
                        "--abort-on-priority-when-disabled") as (url, _):
        yield url


def server_info(url: str) -> dict:
    return requests.get(url + "/get_server_info", headers=A, timeout=10).json()


def _gen(url: str, ids: list[int], n: int, headers: dict) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}}
    r = requests.post(url + "/generate", json=body, headers=headers, timeout=300)
    return {"status": r.status_code, "body": r.json(), "done": time.monotonic()}


def test_keys_from_the_file_are_the_only_way_in(server):
    assert requests.post(server + "/generate", json={"text": "hi"}, timeout=30).status_code == 401
    bad = requests.post(server + "/generate", json={"text": "hi"}, headers={"Authorization": "Bearer nope"}, timeout=30)
    assert bad.status_code == 401
    assert requests.post(server + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                         headers=A, timeout=30).status_code == 200


def test_one_tenants_request_is_not_starved_by_anothers_thousand(server, llama_path):
    """A's 200 go as one call (all reach the scheduler at once); each item's e2e_latency, counted
    from when the call was sent, is an upper bound on when it finished, so the order is exact."""
    prompts = corpus_prompts(llama_path, [8] * 201, seed=11)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(1) as pool:
        sent = time.monotonic()
        flood = pool.submit(requests.post, server + "/generate", json={"input_ids": prompts[:200],
                            "sampling_params": params}, headers=A, timeout=300)
        wait_for(lambda: server_info(server), lambda i: i["waiting"] + i["running"] >= 100, 60)
        single = _gen(server, prompts[200], 8, B)
        done = sorted(sent + item["meta_info"]["e2e_latency"] for item in flood.result().json())
    assert single["status"] == 200
    assert single["done"] < done[149], "tenant B's request waited behind tenant A's queue"
    assert_pool_idle(wait_idle(lambda: server_info(server)))


def test_a_flooding_tenant_cannot_evict_anothers_prefix_below_its_quota(server, llama_path):
    doc = corpus_prompts(llama_path, [600], seed=21)[0]
    first = _gen(server, doc + [5, 6], 2, B)
    assert first["status"] == 200
    flood = corpus_prompts(llama_path, [500] * 30, seed=22)  # 15,000 tokens: 2.4 pools
    with ThreadPoolExecutor(4) as pool:
        assert all(r["status"] == 200 for r in pool.map(lambda p: _gen(server, p, 2, A), flood))
    again = _gen(server, doc + [7, 8], 2, B)
    assert again["body"]["meta_info"]["cached_tokens"] >= len(doc), again["body"]["meta_info"]
    info = wait_idle(lambda: server_info(server))
    # A's pages past its quota go first when pages are needed; idle, its flood may fill what is free
    assert info["tenant_cached_pages_b"] >= len(doc) and info["tenant_cached_pages_a"] > 0, info
    assert_pool_idle(info)


def test_figures_per_tenant_in_metrics_and_the_cache_report(server):
    m = metrics(server)
    assert m['radixrt:tenant_requests_total{tenant="a"}'] >= 200
    assert m['radixrt:tenant_requests_total{tenant="b"}'] >= 2
    assert 'radixrt:tenant_cached_pages{tenant="b"}' in m
    own = requests.get(server + "/cache_report", headers=B, timeout=30).json()
    assert set(own["tenants"]) == {"b"} and own["tenants"]["b"]["hit_rate"] > 0, own["tenants"]


def test_a_tenant_keeps_its_own_cache_unless_it_shares(server, llama_path):
    doc = corpus_prompts(llama_path, [64], seed=31)[0]
    _gen(server, doc + [1], 1, A)
    other = _gen(server, doc + [2], 1, B)
    assert other["body"]["meta_info"]["cached_tokens"] == 0, "tenant B read tenant A's cache"
    _gen(server, doc + [3], 1, {"Authorization": "Bearer key-c"})
    unkeyed_share = _gen(server, doc + [4], 1, {"Authorization": "Bearer key-c"})
    assert unkeyed_share["body"]["meta_info"]["cached_tokens"] >= len(doc)


def test_a_priority_is_refused_where_priorities_are_off(server):
    r = requests.post(server + "/generate", json={"text": "hi", "priority": 3}, headers=A, timeout=30)
    assert r.status_code == 503, r.text
    assert r.json()["error"]["message"] == ("Using priority is disabled for this server. "
                                            "Please send a new request without a priority.")

"""SGLang's request timeouts through a real server (issue 36): the waiting timeout from its
environment variable, the running timeout from radixrt's flag. Each ends its request with
SGLang's 503 and message; nothing leaks and the rid is free at once."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from unittest import mock

import pytest
import requests
from support.helpers import assert_pool_idle, wait_for, wait_idle
from support.http import metrics
from support.server_proc import running_server, server_info


@pytest.fixture(scope="module")
def server(llama_path):
    with mock.patch.dict(os.environ, {"SGLANG_REQ_WAITING_TIMEOUT": "1"}):  # the child keeps its copy
        cm = running_server(llama_path, "--req-running-timeout", "1.5", "--max-running-requests", "1")
        url, _ = cm.__enter__()
    try:
        yield url
    finally:
        cm.__exit__(None, None, None)


def _gen(url: str, rid: str, n: int) -> requests.Response:
    return requests.post(url + "/generate", json={"text": "Once upon a time", "rid": rid, "sampling_params": {
        "max_new_tokens": n, "ignore_eos": True}}, timeout=60)


def test_both_timeouts_end_requests_with_sglangs_503_and_free_everything(server):
    with ThreadPoolExecutor(2) as pool:
        running = pool.submit(_gen, server, "long", 4000)  # runs far longer than 1.5 s
        wait_for(lambda: server_info(server), lambda i: i["running"] == 1, 30)
        waiting = _gen(server, "queued", 4)  # no slot until the long one ends: it times out first
        ran = running.result()
    assert waiting.status_code == 503, waiting.text
    assert waiting.json()["error"]["message"] == "Request waiting timeout reached."
    assert ran.status_code == 503, ran.text
    assert ran.json()["error"]["message"] == "Request running timeout reached."
    m = metrics(server)
    assert m['radixrt:requests_rejected_total{reason="waiting_timeout"}'] == 1
    assert m['radixrt:requests_rejected_total{reason="running_timeout"}'] == 1
    assert_pool_idle(wait_idle(lambda: server_info(server)))
    for rid in ("long", "queued"):  # both rids are free again
        assert _gen(server, rid, 2).status_code == 200

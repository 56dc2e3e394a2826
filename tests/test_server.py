"""The HTTP server through real processes on 127.0.0.1: SGLang's native API (and its own
client), the OpenAI API (and the official client), metrics, bad input, disconnects,
API keys, and clean stops when signalled or when a child dies."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time

import pytest
import radixrt
import requests
from support.helpers import all_gone, corpus_prompts, wait_for
from support.server_proc import SERVER_ARGS, assert_healthy_and_idle, child_pids, running_server, spawned_children

from support.http import metrics, post

# `server` (conftest.py) is the session's shared server, started with SERVER_ARGS; the tests that
# kill, signal or lock a server start their own with the same flags.
GREEDY = {"max_new_tokens": 12, "temperature": 0}
ABORTS = 'radixrt:requests_total{finish_reason="abort"}'
GENERATED = "sglang:generation_tokens_total"


def stream_events(resp: requests.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith(b"data: "):
            payload = line[6:]
            events.append("[DONE]" if payload == b"[DONE]" else json.loads(payload))
    return events


def test_greedy_outputs_equal_the_engine(server, llama_path):
    prompts = corpus_prompts(llama_path, [7, 40, 130, 300], seed=11)
    res = post(server, "/generate", {"input_ids": prompts, "sampling_params": GREEDY}).json()
    with radixrt.Engine(model_path=str(llama_path), page_size=16, max_total_tokens=16384) as engine:
        want = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [r["output_ids"] for r in res] == [w["output_ids"] for w in want]
    assert [r["text"] for r in res] == [w["text"] for w in want]


def test_64_concurrent_streams_join_into_the_non_stream_text(server, llama_path):
    prompts = corpus_prompts(llama_path, [10 + 3 * i for i in range(64)], seed=12)

    def one(ids):
        full = post(server, "/generate", {"input_ids": ids, "sampling_params": GREEDY}).json()
        with post(server, "/generate", {"input_ids": ids, "sampling_params": GREEDY, "stream": True}, stream=True) as r:
            events = stream_events(r)
        return full, events

    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        results = list(pool.map(one, prompts))
    for full, events in results:
        assert events[-1] == "[DONE]"
        texts = [e["text"] for e in events[:-1]]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:])), "stream text is cumulative"
        assert texts[-1] == full["text"] and events[-2]["output_ids"] == full["output_ids"]
        assert events[-2]["meta_info"]["finish_reason"] is not None
    assert_healthy_and_idle(server)


BAD = [
    ("/generate", "{not json", "malformed JSON"),
    ("/generate", {"text": 123}, "text: expected `str"),
    ("/generate", {"text": "hi", "sampling_params": "hot"}, "object"),
    ("/generate", {"text": "hi", "stream": "yes"}, "stream"),
    ("/generate", {"text": ""}, "empty"),
    ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"input_ids": [1] * 5000}, "context length"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "[a-"}}, "sampling_params.regex is not a valid grammar"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": "{not json"}}, "json_schema is not a valid grammar"),
    ("/generate", {"text": "hi", "sampling_params": {"json_schema": '{"type": "wat"}'}}, "Unsupported type"),
    ("/generate", {"text": "hi", "sampling_params": {"regex": "a", "ebnf": "root ::= [a]"}}, "regex and ebnf"),
    ("/generate", {"text": "hi", "stream": True, "sampling_params": {"regex": "(a)\\1"}}, "Backreference"),
    ("/generate", {"text": "hi", "image_data": "x.png"}, "image_data"),
    ("/generate", {"text": "hi", "bogus": 1}, "bogus"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes"}, "echo"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -2}, "temperature"),
]


@pytest.mark.parametrize("path,body,words", BAD, ids=[w for _, _, w in BAD])
def test_bad_input_gets_a_4xx_naming_the_problem_and_the_server_serves_on(server, path, body, words):
    r = post(server, path, body)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert words in err["message"] and set(err) >= {"message", "type", "param", "code"}
    ok = post(server, "/generate", {"text": "still here", "sampling_params": {"max_new_tokens": 2}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2


def test_native_details_the_sglang_client_relies_on(server):
    info = requests.get(server + "/get_model_info", timeout=10).json()
    assert info["model_path"].endswith("llama-tiny")
    info = requests.get(server + "/get_server_info", timeout=10).json()  # how the worker's linears compute, and why
    assert info["weight_packing"] in ("onednn", "none") and info["weight_packing_reason"]
    assert info["matmul_dtype"] and info["matmul_dtype_reason"]
    r = post(server, "/generate", {"text": "The river", "sampling_params": {"max_new_tokens": 0}}).json()
    assert r["text"] == "" and r["meta_info"]["prompt_tokens"] == 2
    r = post(server, "/generate", {"text": "The river runs", "sampling_params": {"max_new_tokens": 2, "stop": [], "temperature": None},
                                   "return_logprob": True, "return_text_in_logprobs": True}).json()
    inp = r["meta_info"]["input_token_logprobs"]
    assert len(inp) == 1 and isinstance(inp[0][0], float) and isinstance(inp[0][2], str)
    r = post(server, "/generate", {"text": "The river runs", "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
                                   "logprob_start_len": 0, "top_logprobs_num": 2}).json()
    inp = r["meta_info"]["input_token_logprobs"]
    assert inp[0][0] is None and inp[0][2] is None and len(inp) == r["meta_info"]["prompt_tokens"]
    assert len(r["meta_info"]["output_top_logprobs"][0]) == 2
    batch = post(server, "/generate", {"text": ["one", "two", "three"], "sampling_params": {"max_new_tokens": 1}}).json()
    assert isinstance(batch, list) and len(batch) == 3
    assert requests.get(server + "/health_generate", timeout=30).status_code == 200


def test_sglang_frontend_programs_run_against_the_server(server):
    import sglang as sgl  # installed by scripts/setup_env.sh

    @sgl.function
    def qa(s, q):
        s += "Question: " + q + "\nAnswer:" + sgl.gen("answer", max_tokens=8, temperature=0, stop="\n\n")
        s += "\nPick: " + sgl.select("pick", choices=["river", "train", "bread"])

    @sgl.function
    def tree(s):
        s += "The trunk of the story goes on and on. "
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f"Branch {i}:" + sgl.gen("b", max_tokens=6, temperature=0)
        forks.join()

    backend = sgl.RuntimeEndpoint(server)
    state = qa.run(q="What is a river?", backend=backend)
    assert state["pick"] in ("river", "train", "bread")
    meta = state.get_meta_info("answer")
    assert meta["completion_tokens"] <= 8 and "\n\n" not in state["answer"]
    states = qa.run_batch([{"q": "a"}, {"q": "b"}, {"q": "c"}], backend=backend)
    assert len(states) == 3 and all(s["pick"] in ("river", "train", "bread") for s in states)
    forked = tree.run(backend=backend)
    assert len(forked["b"]) == 3
    streamed = qa.run(q="What is a river?", stream=True, backend=backend)
    assert "".join(streamed.text_iter()) == state.text()


def test_openai_client(server):
    import openai
    client = openai.OpenAI(base_url=server + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    prompt = "The library opened early because"
    c = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, n=2, logprobs=2)
    assert len(c.choices) == 2 and c.choices[0].text == c.choices[1].text
    assert len(c.choices[0].logprobs.token_logprobs) == 8 and c.choices[0].finish_reason == "length"
    again = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    stopped = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0, stop=[c.choices[0].text[3:5]])
    assert stopped.choices[0].finish_reason == "stop" and c.choices[0].text[3:5] not in stopped.choices[0].text
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about trains."}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens <= 10
    parts = [ch.choices[0].delta.content or "" for ch in client.chat.completions.create(
        model=model, messages=messages, max_tokens=10, temperature=0, stream=True) if ch.choices]
    assert "".join(parts) == chat.choices[0].message.content
    # as in SGLang, the model name is not checked: the answer names what was asked for
    assert client.completions.create(model="nope", prompt="x", max_tokens=1).model == "nope"


def test_a_client_that_disconnects_mid_stream_gives_its_pages_back(server):
    assert_healthy_and_idle(server)  # earlier tests' requests are all counted
    before = metrics(server)
    # NOTE: as long a request as the tiny model's 4096-token context allows, left after its first two
    # chunks: the compiled kernels decode it in about a second, so a shorter one could finish before
    # a loaded machine gets the abort through (seen once with 3000 tokens, 6 chunks)
    body = {"text": "Once upon a time", "stream": True, "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    with post(server, "/generate", body, stream=True) as r:
        lines = r.iter_lines()
        for _ in range(2):
            next(lines)
    assert_healthy_and_idle(server)
    after = wait_for(lambda: metrics(server), lambda m: m.get(ABORTS, 0) > before.get(ABORTS, 0), timeout=5)
    aborted = after.get(ABORTS, 0) - before.get(ABORTS, 0)
    generated = after[GENERATED] - before[GENERATED]
    # it was aborted, not finished: one more abort, and fewer tokens than the 4000 it asked for
    assert aborted == 1 and 0 < generated < 4000, (aborted, generated)


def test_metrics_flush_and_abort(server):
    post(server, "/generate", {"text": "count me", "sampling_params": {"max_new_tokens": 3}})
    samples = metrics(server)
    for name in ("sglang:time_to_first_token_seconds_count", "sglang:inter_token_latency_seconds_count",
                 "sglang:e2e_request_latency_seconds_count", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                 "sglang:cached_tokens_total", "sglang:cache_hit_rate", "sglang:num_running_reqs",
                 "sglang:num_queue_reqs", "sglang:token_usage", "radixrt:evicted_pages_total", "radixrt:retractions_total"):
        assert name in samples, name
    assert samples[GENERATED] > 0 and samples["sglang:prompt_tokens_total"] > 0
    assert post(server, "/flush_cache", {}).status_code == 200
    assert requests.get(server + "/get_server_info", timeout=10).json()["cached_pages"] == 0
    body = {"text": "abort me", "rid": "to-abort", "stream": True, "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    with post(server, "/generate", body, stream=True) as r:
        lines = r.iter_lines()
        next(lines)
        assert post(server, "/abort_request", {"rid": "to-abort"}).status_code == 200
        events = [json.loads(l[6:]) for l in lines if l.startswith(b"data: {")]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
    assert_healthy_and_idle(server)


def test_a_dead_child_fails_its_requests_and_brings_the_server_down(llama_path):
    """SIGKILL of a backend process: /health turns 503 at once, waiting non-streaming chat
    requests get a 5xx (never a 200 with partial text), and the server exits non-zero."""
    with running_server(llama_path, *SERVER_ARGS) as (url, proc):
        children = child_pids(proc.pid)
        chat = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 3000,
                "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            futures = [pool.submit(post, url, "/v1/chat/completions", chat) for _ in range(4)]
            time.sleep(1.0)  # they are running
            os.kill(max(spawned_children(proc.pid)), signal.SIGKILL)  # the scheduler starts last
            killed = time.monotonic()
            status = None
            while time.monotonic() - killed < 2:
                try:
                    status = requests.get(url + "/health", timeout=1).status_code
                except requests.ConnectionError:
                    status = "closed"
                if status != 200:
                    break
            assert status in (503, "closed") and time.monotonic() - killed < 0.5, status
            answers = [f.result() for f in futures]
        assert all(r.status_code >= 500 for r in answers), [(r.status_code, r.text[:200]) for r in answers]
        assert all("exited with code" in r.json()["error"]["message"] for r in answers)
        code = proc.wait(15)
        assert code != 0
        log = proc.stdout.read()
        assert "died" in log and "exited with code" in log
        assert all_gone(children)


def test_sigterm_under_32_streams_answers_every_client_and_exits_0(llama_path):
    """Streams that can finish within --graceful-shutdown-timeout do; the rest get an error
    event with the reason. No client is left without an answer, no traceback is logged."""
    with running_server(llama_path, *SERVER_ARGS, "--graceful-shutdown-timeout", "3") as (url, proc):
        def stream(i: int) -> list:
            tokens = 6 if i % 2 else 3000  # half finish in time, half cannot
            body = {"text": f"stream {i}", "stream": True, "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True}}
            with post(url, "/generate", body, stream=True) as r:
                return stream_events(r)

        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            futures = [pool.submit(stream, i) for i in range(32)]
            time.sleep(1.5)
            proc.send_signal(signal.SIGTERM)
            results = [f.result(timeout=60) for f in futures]
        assert proc.wait(30) == 0
        finished = errored = 0
        for events in results:
            assert events and events[-1] == "[DONE]", events[-3:]
            last = events[-2]
            if "error" in last:
                assert "shutting down" in last["error"]["message"] and last["error"]["code"] == 503
                errored += 1
            else:
                assert last["meta_info"]["finish_reason"]["type"] == "length"
                finished += 1
        assert finished >= 16 and errored >= 1, (finished, errored)
        assert "Traceback" not in proc.stdout.read()


def test_api_keys_and_sigterm_stops_every_process(llama_path, model_paths):
    keys = ("--api-key", "sekrit", "--admin-api-key", "boss")
    with running_server(llama_path, *SERVER_ARGS, *keys) as (url, proc):
        for open_path in ("/health", "/health_generate", "/metrics"):  # probes and scrapers need no key
            assert requests.get(url + open_path, timeout=30).status_code == 200, open_path
        r = post(url, "/generate", {"text": "hi"})
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        assert requests.get(url + "/v1/models", timeout=10, headers={"Authorization": "Bearer wrong"}).status_code == 401
        for header in ("Bearer sekrit", "bearer sekrit", "BEARER  sekrit"):  # the scheme in any case
            ok = post(url, "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}, headers={"Authorization": header})
            assert ok.status_code == 200, header
        # admin routes take the admin key, not the ordinary one (SGLang's ADMIN_OPTIONAL)
        assert post(url, "/flush_cache", {}, headers={"Authorization": "Bearer sekrit"}).status_code == 401
        assert post(url, "/abort_request", {"rid": "x"}, headers={"Authorization": "Bearer sekrit"}).status_code == 401
        assert post(url, "/flush_cache", {}, headers={"Authorization": "Bearer boss"}).status_code == 200
        assert post(url, "/abort_request", {"rid": "x"}, headers={"Authorization": "Bearer boss"}).status_code == 200
        assert post(url, "/generate", {"text": "hi"}, headers={"Authorization": "Bearer boss"}).status_code == 401
        # a weight update is an admin route; a checkpoint that does not fit is a 400 saying why, SGLang's body
        update = {"model_path": str(model_paths["qwen2"])}
        assert post(url, "/update_weights_from_disk", update, headers={"Authorization": "Bearer sekrit"}).status_code == 401
        refused = post(url, "/update_weights_from_disk", update, headers={"Authorization": "Bearer boss"})
        assert refused.status_code == 400 and not refused.json()["success"], refused.text
        assert "model_type" in refused.json()["message"] and refused.json()["num_paused_requests"] == 0
        bad = post(url, "/update_weights_from_disk", {**update, "flush_cache": False}, headers={"Authorization": "Bearer boss"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "flush_cache"
        # the hit-rate report takes the ordinary key
        assert requests.get(url + "/cache_report", timeout=10, headers={"Authorization": "Bearer sekrit"}).status_code == 200
        assert requests.get(url + "/cache_report", timeout=10).status_code == 401
        info = requests.get(url + "/get_server_info", timeout=10, headers={"Authorization": "Bearer sekrit"}).json()
        assert "api_key" not in info and "admin_api_key" not in info
        children = child_pids(proc.pid)
        assert len(children) >= 2
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - start < 10
        assert all_gone(children)


def test_without_an_admin_key_admin_routes_take_the_api_key():
    from radixrt.config import ServerArgs
    from radixrt.config_views import HttpConfig
    from radixrt.server.http_server import bearer_matches, required_key

    args = HttpConfig.of(ServerArgs(model_path="m", api_key="k"))
    assert required_key("/flush_cache", args) == "k" and required_key("/health_generate", args) is None
    assert required_key("/metrics", args) is None and required_key("/generate", args) == "k"
    only_admin = HttpConfig.of(ServerArgs(model_path="m", admin_api_key="a"))
    assert required_key("/generate", only_admin) is None and required_key("/abort_request", only_admin) == "a"
    assert bearer_matches("Bearer k", "k") and bearer_matches("bearer   k ", "k")
    assert not bearer_matches("Bearer kk", "k") and not bearer_matches("Basic k", "k") and not bearer_matches(None, "k")

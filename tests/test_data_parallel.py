"""Data parallelism behind SGLang's own router (sglang_router): `launch_server --dp-size 2` from
one command (outputs, placement, clean stop), a router started by hand in front of the same two
radixrt servers, the error without the router installed, and the parts of
radixrt/launch/ that need no model (shares, command lines, watching, orphans).

One deployment serves the module (two replicas on one core each, from the parent's split); its
replicas are found from their command lines. Outputs are greedy with an explicit token limit, so
a replica asked directly ("one server alone") and the router must agree exactly.

NOTE: the router adds fields of its own to what it forwards (`model`, `return_hidden_states`,
`log_metrics`, ... on /generate; `continue_final_message`, `separate_reasoning`,
`max_completion_tokens`, ... on chat): a server that refuses any of them fails these tests with
the 400 that names the field, which is the point of them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import importlib.util
import json
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pytest
import requests
from support.helpers import all_gone, corpus_ids, process_alive, tokenizer, wait_for
from support.server_proc import ROOT, child_pids, free_port, running_server, stop

from radixrt.cli_args import add_server_args, server_args_from
from radixrt.config import ServerArgs
from radixrt.launch.data_parallel import DataParallelServer
from radixrt.launch.process import Process
from radixrt.launch.replicas import Share, replica_args, server_flags, split_cores, split_gpus
from support import http

needs_router = pytest.mark.skipif(importlib.util.find_spec("sglang_router") is None,
                                  reason="the router extra is not installed: pip install 'radixrt[router]'")
KEY = "dp-key"  # the deployment asks for an api key: the router must pass the clients' on, and ask for it too
AUTH = {"Authorization": f"Bearer {KEY}"}
FLAGS = ("--max-total-tokens", "4096", "--page-size", "16", "--graceful-shutdown-timeout", "5", "--api-key", KEY)
MAX_TOKENS = 8
SLEEPER = [sys.executable, "-c", "import time; time.sleep(120)"]


# -- requests every deployment answers: the same greedy outputs wherever they run --------------


def post_ok(url: str, path: str, body: dict[str, Any], **kw: Any) -> requests.Response:
    """support.http.post with the servers' key, asserting a 200."""
    r = http.post(url, path, body, headers=AUTH, **kw)
    assert r.status_code == 200, f"{path}: {r.status_code} {r.text}"
    return r


def streamed_text(url: str, prompt: str) -> str:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 0}, "stream": True}
    with post_ok(url, "/generate", body, stream=True) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"[DONE]", events[-1:]
    return json.loads(events[-2])["text"]


def outputs(url: str, prompts: list[str]) -> dict[str, Any]:
    """One request of each kind (a different prompt each, so they spread over replicas)."""
    sampling = {"max_new_tokens": MAX_TOKENS, "temperature": 0}
    gen = post_ok(url, "/generate", {"text": prompts[0], "sampling_params": sampling}).json()
    completion = post_ok(url, "/v1/completions", {"model": "m", "prompt": prompts[1], "max_tokens": MAX_TOKENS, "temperature": 0}).json()
    chat = post_ok(url, "/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": prompts[2]}],
                                              "max_tokens": MAX_TOKENS, "temperature": 0}).json()
    return {
        "generate": (gen["text"], gen["output_ids"]),
        "generate_stream": streamed_text(url, prompts[3]),
        "completion": (completion["choices"][0]["text"], completion["usage"]["completion_tokens"]),
        "chat": (chat["choices"][0]["message"]["content"], chat["usage"]["completion_tokens"]),
    }


def ask(url: str, text: str, max_new_tokens: int = 1) -> None:
    post_ok(url, "/generate", {"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True}})


def counters(url: str) -> tuple[int, int]:
    info = requests.get(url + "/get_server_info", headers=AUTH, timeout=10).json()
    return info["prompt_tokens"], info["cached_prompt_tokens"]


def wait_router_ready(url: str, replicas: int) -> None:
    """Until the router lists every replica as healthy."""
    def healthy() -> int:
        with contextlib.suppress(requests.RequestException, ValueError, KeyError):
            return sum(w["is_healthy"] for w in requests.get(url + "/workers", headers=AUTH, timeout=5).json()["workers"])
        return 0

    assert wait_for(healthy, lambda n: n == replicas, timeout=60) == replicas


# -- the deployment the module shares ---------------------------------------------------------


@dataclass(frozen=True)
class Deployment:
    url: str  # the router's
    proc: subprocess.Popen  # launch_server --dp-size 2
    replicas: list[int]  # the replicas' pids
    replica_urls: list[str]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = child_pids(todo.pop())
        out += kids
        todo += kids
    return out


def replica_port(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return int(argv[argv.index("--port") + 1])


@pytest.fixture(scope="module")
def dp(llama_path) -> Iterator[Deployment]:
    with running_server(llama_path, "--dp-size", "2", *FLAGS) as (url, proc):
        wait_router_ready(url, 2)
        replicas = [p for p in child_pids(proc.pid) if b"radixrt.launch_server" in Path(f"/proc/{p}/cmdline").read_bytes()]
        yield Deployment(url, proc, replicas, [f"http://127.0.0.1:{replica_port(p)}" for p in replicas])


@pytest.fixture(scope="module")
def prompts(llama_path) -> list[str]:
    tok, ids = tokenizer(llama_path), corpus_ids(llama_path)
    return [tok.decode(ids[i * 50 : i * 50 + 12 + 5 * i]) for i in range(4)]


@pytest.fixture(scope="module")
def alone(dp, prompts) -> dict[str, Any]:
    """The outputs of one server alone: a replica asked directly."""
    return outputs(dp.replica_urls[0], prompts)


@contextlib.contextmanager
def router(worker_urls: list[str], policy: str = "cache_aware", *flags: str) -> Iterator[str]:
    """SGLang's router started by hand, as its own README does it (flags: more of its options)."""
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *worker_urls, "--policy", policy, "--log-level", "warn", "--api-key", KEY,
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_router_ready(url, len(worker_urls))
        yield url
    finally:
        stop(proc)


# -- through the routers -----------------------------------------------------------------------


@needs_router
def test_dp_size_2_serves_like_one_server_on_a_core_per_replica(dp, alone, prompts):
    assert outputs(dp.url, prompts) == alone
    assert requests.post(dp.url + "/generate", json={"text": "hi"}, timeout=60).status_code == 401  # no key
    shares = split_cores(sorted(os.sched_getaffinity(0)), 2)
    assert sorted(sorted(os.sched_getaffinity(r)) for r in dp.replicas) == [list(s.cores) for s in shares]


@needs_router
def test_cache_aware_router_in_front_of_two_servers_sends_a_document_where_it_is_cached(dp, alone, prompts, llama_path):
    tok, ids = tokenizer(llama_path), corpus_ids(llama_path)
    docs = [tok.decode(ids[1000:1300]), tok.decode(ids[2000:2300])]
    servers = dp.replica_urls
    # NOTE: with its default thresholds, sglang-router 0.3.2 calls two servers with 1 and 0
    # requests in flight balanced and sends a cache miss to its smallest tree, which counts only
    # servers that have been sent something: every miss here went to the first server. Strict
    # thresholds make any difference in load an imbalance, which it settles by the least-loaded
    # server; with equal loads it routes by cache.
    with router(servers, "cache_aware", "--balance-abs-threshold", "0", "--balance-rel-threshold", "1.0") as url:
        assert outputs(url, prompts) == alone
        # The second document's first question is sent while the first's streams (a token read,
        # so the router counts it in flight): it goes to the server the first does not load, so
        # each document starts on its own server. Sent from two threads at once, both were once
        # placed before the router counted either, on the first server...
        body = {"text": docs[0] + " Who?", "stream": True, "sampling_params": {"max_new_tokens": 256, "ignore_eos": True}}
        with post_ok(url, "/generate", body, stream=True) as first:
            events = (line for line in first.iter_lines() if line.startswith(b"data: "))
            next(events)
            ask(url, docs[1] + " Who?", max_new_tokens=256)
            assert list(events)[-1] == b"data: [DONE]"
        homes = []
        for doc in docs:  # ...and its later questions follow it there
            before = [counters(u) for u in servers]
            for q in (" What happened next?", " Where was it?", " Why?"):
                ask(url, doc + q)
            delta = [(p1 - p0, c1 - c0) for (p0, c0), (p1, c1) in zip(before, [counters(u) for u in servers])]
            served = [i for i, (prompt_tokens, _) in enumerate(delta) if prompt_tokens > 0]
            assert len(served) == 1, f"a document's questions went to both servers: {delta}"
            prompt_tokens, cached = delta[served[0]]
            assert cached / prompt_tokens > 0.7, f"the document was not cached where its questions went: {delta}"
            homes.append(served[0])
        assert sorted(homes) == [0, 1], f"both documents on one server: {homes}"


@needs_router
def test_dp_size_2_spreads_a_document_s_questions_under_load_and_keeps_sequential_ones_home(dp, llama_path):
    """launch_server's router thresholds (ServerArgs.router_*): with sglang-router's own (abs 64)
    all these questions would go to the document's home. A request sent alone sees equal loads,
    so it goes where its prefix is (and a sequential cold miss to the first replica, whatever
    the thresholds: see docs/architecture.md)."""
    tok, ids = tokenizer(llama_path), corpus_ids(llama_path)
    doc = tok.decode(ids[3000:3300])
    before = [counters(u) for u in dp.replica_urls]
    ask(dp.url, doc)
    home = [p1 - p0 for (p0, _), (p1, _) in zip(before, [counters(u) for u in dp.replica_urls])]
    assert sorted(n > 0 for n in home) == [False, True], home
    for q in (" Who?", " When?"):  # one at a time: each goes home
        ask(dp.url, doc + q)
    alone = [p1 - p0 for (p0, _), (p1, _) in zip(before, [counters(u) for u in dp.replica_urls])]
    assert [n > 0 for n in alone] == [n > 0 for n in home], (home, alone)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # eight at once, 32 forced tokens each
        list(pool.map(lambda i: ask(dp.url, doc + f" Question {i}?", max_new_tokens=32), range(8)))
    loaded = [p1 - p0 for (p0, _), (p1, _) in zip(before, [counters(u) for u in dp.replica_urls])]
    assert all(n > 0 for n in loaded), f"every question went to the document's home: {loaded}"


@needs_router
def test_dp_size_2_stops_cleanly_on_sigterm(dp):
    """Last of the tests on `dp`: it stops the deployment."""
    pids = descendants(dp.proc.pid)
    assert len(pids) >= 2 + 2 * 2 + 1, pids  # the replicas, their scheduler and worker each, the router
    dp.proc.send_signal(signal.SIGTERM)
    assert dp.proc.wait(60) == 0
    assert all_gone(pids), [p for p in pids if process_alive(p)]


def test_dp_size_without_the_router_says_how_to_install_it(llama_path, tmp_path):
    shim = tmp_path / "sglang_router"
    shim.mkdir()
    (shim / "__init__.py").write_text('raise ImportError("simulated: sglang_router is not installed")\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "radixrt.launch_server", "--model-path", str(llama_path), "--port", str(free_port()),
           "--dp-size", "2"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert 'pip install "radixrt[router]"' in done.stderr and "simulated" in done.stderr, done.stderr
    assert "replica 0" not in done.stdout + done.stderr, "something started before the check"


# -- without a model -------------------------------------------------------------------------


@needs_router
def test_a_process_that_exits_stops_the_deployment(caplog):
    dp = DataParallelServer(ServerArgs(model_path="m", dp_size=2, device="cpu", graceful_shutdown_timeout=1))
    dp.replicas = [Process("replica 0", SLEEPER, own_group=True),
                   Process("replica 1", [sys.executable, "-c", "raise SystemExit(3)"], own_group=True)]
    dp.router = Process("the router", SLEEPER, own_group=True)
    pids = [p.pid for p in (*dp.replicas, dp.router)]
    with caplog.at_level(logging.ERROR, logger="radixrt.server"):
        assert dp.serve() == 1
    dp.stop()
    assert f"replica 1 (pid {pids[1]}) exited with code 3; stopping the router and the replicas" in caplog.text
    assert all_gone(pids)


def test_started_processes_die_with_the_parent():
    """Even a parent killed with SIGKILL (no cleanup runs) leaves no replica or router behind."""
    code = ("import sys; from radixrt.launch.process import Process; "
            f"p = Process('replica 0', {SLEEPER!r}, own_group=True); print(p.pid, flush=True); sys.stdin.read()")
    parent = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert process_alive(child)
    parent.kill()
    parent.wait()
    assert all_gone([child])


def test_cores_and_gpus_split_into_disjoint_shares():
    assert split_cores([0, 1, 2, 3, 4], 2) == [Share(cores=(0, 1)), Share(cores=(2, 3, 4))]
    assert split_gpus(["0", "1", "2", "3"], 2, 2) == [Share(gpus=("0", "1")), Share(gpus=("2", "3"))]
    with pytest.raises(ValueError, match="dp_size 3 needs a core per replica"):
        split_cores([0, 1], 3)
    with pytest.raises(ValueError, match="needs 4 GPUs; 3 are visible"):
        split_gpus(["0", "1", "2"], 2, 2)
    with pytest.raises(ValueError, match="dp_size must be >= 1"):
        ServerArgs(model_path="m", dp_size=0)


def test_replica_command_line_gives_back_the_replica_args():
    args = ServerArgs(model_path="m", dp_size=2, api_key="k", disable_radix_cache=True, page_size=16,
                      graceful_shutdown_timeout=2.5, host="0.0.0.0", port=8000)
    replica = replica_args(args, 4321, on_cpu=True)
    assert (replica.host, replica.port, replica.dp_size) == ("127.0.0.1", 4321, 1)
    assert replica.mem_fraction_static is not None and replica.mem_fraction_static < 0.3  # a share of the host's memory
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    assert server_args_from(parser.parse_args(server_flags(replica))) == replica

"""Multi-LoRA through the HTTP surface (issue 37), against one server on the tiny llama that
starts with two adapters (a1, a2; --max-loras-per-batch 2, --max-loaded-loras 3).

What SGLang 0.5.9 clients see: /load_lora_adapter and /unload_lora_adapter take every field of
SGLang's own request structs (read with `ast` from the installed sglang package, as
test_sglang_fields does) and answer its LoRAUpdateOutput, 200 or 400; every refusal names the
adapter; /v1/models lists the adapters under the base; /generate's lora_path (one or per prompt)
and the OpenAI routes' "model": "base:adapter" (which wins over lora_path) pick the adapter;
the prefix cache is per adapter; the metrics count by adapter; and nothing leaks a page.

The tests run in file order against the one server: the last one checks the pool.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import requests
from support.lora_adapters import ensure_adapter
from support.server_proc import (
    SERVER_PAGE_SIZE,
    assert_healthy_and_idle,
    running_server,
    server_info,
)
from test_sglang_fields import (  # the same reader of SGLang's source
    MISSING,
    class_fields,
)

from radixrt.settings.lora import AdapterError, LoraRef, read_adapter

SERVED = "tiny-llama"
# Short prompts as token ids (the tiny vocab has 1024): several, since one random adapter may
# leave one prompt's greedy tokens unchanged (tests/support/lora_adapters.py, B_SCALE).
PROMPTS = [[5, 17, 99, 230, 41], [300, 12, 7, 88], [401, 402, 403, 404, 405, 406], [9, 900, 19, 190]]
GREEDY = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
LOAD_FIELDS = class_fields("managers/io_struct.py", "LoadLoRAAdapterReqInput", "BaseReq")
UNLOAD_FIELDS = class_fields("managers/io_struct.py", "UnloadLoRAAdapterReqInput", "BaseReq")
OUTPUT_FIELDS = class_fields("managers/io_struct.py", "LoRAUpdateOutput")


@pytest.fixture(scope="module")
def adapters(llama_path) -> dict[str, Path]:
    return {f"a{i}": ensure_adapter(llama_path, f"a{i}", seed=i) for i in (1, 2, 3)}


@pytest.fixture(scope="module")
def server(llama_path, adapters):
    with running_server(llama_path, "--page-size", str(SERVER_PAGE_SIZE), "--max-total-tokens", "4096",
                        "--served-model-name", SERVED, "--max-loras-per-batch", "2", "--max-loaded-loras", "3",
                        "--lora-paths", f"a1={adapters['a1']}", f"a2={adapters['a2']}") as (url, _):
        yield url


def post(url: str, path: str, body: dict) -> requests.Response:
    return requests.post(url + path, json=body, timeout=60)


def generate(url: str, ids: list, lora=None, **sampling) -> requests.Response:
    return post(url, "/generate", {"input_ids": ids, "lora_path": lora, "sampling_params": {**GREEDY, **sampling}})


def outputs(r: requests.Response) -> list[list[int]]:
    assert r.status_code == 200, r.text
    body = r.json()
    return [o["output_ids"] for o in (body if isinstance(body, list) else [body])]


def load(url: str, name: str, path: Path | str, **extra) -> requests.Response:
    return post(url, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path), **extra})


def unload(url: str, name: str, **extra) -> requests.Response:
    return post(url, "/unload_lora_adapter", {"lora_name": name, **extra})


def accepted(r: requests.Response) -> dict[str, str]:
    """A 200 LoRAUpdateOutput; returns its loaded_adapters. (SGLang 0.5.9's error_message on
    success is "", ours null: either passes.)"""
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and not body["error_message"], body
    return body["loaded_adapters"]


def refused(r: requests.Response, *words: str) -> str:
    """A 400 LoRAUpdateOutput whose error_message holds every word; returns the message."""
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["success"] is False and all(w in body["error_message"] for w in words), body
    return body["error_message"]


def error_message(r: requests.Response) -> str:
    assert r.status_code == 400, r.text
    return r.json()["error"]["message"]


def paths(adapters: dict[str, Path], *names: str) -> dict[str, str]:
    return {n: str(adapters[n]) for n in names}


# -- 1. SGLang's request and reply shapes ----------------------------------------------------

def test_the_routes_take_every_field_of_sglangs_structs_and_answer_its_reply(server, adapters):
    assert set(LOAD_FIELDS) == {"lora_name", "lora_path", "pinned", "lora_id", "rid", "http_worker_ipc"}
    assert set(UNLOAD_FIELDS) == {"lora_name", "lora_id", "rid", "http_worker_ipc"}
    assert LOAD_FIELDS["lora_name"] is MISSING and LOAD_FIELDS["pinned"] is False
    values = {"lora_name": "a3", "lora_path": str(adapters["a3"]), "pinned": False, "lora_id": "0" * 32,
              "rid": "lora-admin-1", "http_worker_ipc": None}
    r = post(server, "/load_lora_adapter", {f: values[f] for f in LOAD_FIELDS})
    assert accepted(r) == paths(adapters, "a1", "a2", "a3")
    # LoRAUpdateOutput's own fields (SGLang's orjson also writes its BaseReq's rid and http_worker_ipc, as null)
    assert set(r.json()) == set(OUTPUT_FIELDS) == {"success", "error_message", "loaded_adapters"}
    r = post(server, "/unload_lora_adapter", {f: values[f] for f in UNLOAD_FIELDS})
    assert accepted(r) == paths(adapters, "a1", "a2")
    assert post(server, "/unload_lora_adapter", {"lora_name": "a1", "lora_paths": "x"}).status_code == 400


# -- 2. loading and unloading at run time ----------------------------------------------------

def test_an_adapter_loaded_at_run_time_serves_and_is_gone_once_unloaded(server, adapters):
    assert accepted(load(server, "a3", adapters["a3"])) == paths(adapters, "a1", "a2", "a3")
    cards = requests.get(server + "/v1/models", timeout=10).json()["data"]
    assert [c["id"] for c in cards] == [SERVED, "a1", "a2", "a3"]
    assert all(c["parent"] == SERVED and c["root"] == str(adapters[c["id"]]) for c in cards[1:])

    base, a3 = outputs(generate(server, PROMPTS)), outputs(generate(server, PROMPTS, "a3"))
    assert base != a3 and all(len(o) == GREEDY["max_new_tokens"] for o in a3)
    assert outputs(generate(server, PROMPTS[0], "a3")) == a3[:1]  # deterministic, alone or batched

    assert accepted(unload(server, "a3")) == paths(adapters, "a1", "a2")
    assert [c["id"] for c in requests.get(server + "/v1/models", timeout=10).json()["data"]] == [SERVED, "a1", "a2"]
    assert "a3" in error_message(generate(server, PROMPTS[0], "a3"))
    refused(unload(server, "a3"), "a3", "does not exist")
    # named before the list of loaded ones (SGLang 0.5.9: "Failed to load LoRA adapter a1 because it is already loaded")
    assert "a1" in refused(load(server, "a1", adapters["a1"])).split("Loaded")[0]


# -- 3. refusals name the adapter -------------------------------------------------------------

def test_an_adapter_the_pool_cannot_hold_is_refused_by_name(server, llama_path, adapters, tmp_path):
    refused(load(server, "empty", tmp_path), "empty")
    refused(load(server, "wide", ensure_adapter(llama_path, "wide", seed=4, r=16)), "wide", "rank")
    # lm_head: a target outside every server's sites here (SGLang 0.5.9 serves it; radixrt refuses it)
    head = ensure_adapter(llama_path, "head", seed=5, r=4, target_modules=["lm_head"])
    r = load(server, "head", head)
    refused(r, "head", "lm_head")
    assert r.json()["loaded_adapters"] == paths(adapters, "a1", "a2")  # nothing registered


def test_an_adapter_targeting_a_site_outside_the_servers_is_refused_by_name(adapters):
    with pytest.raises(AdapterError, match=r"'a1'.*gate_up_proj"):
        read_adapter(LoraRef("a1", str(adapters["a1"])), 8, sites=("qkv_proj",))
    with pytest.raises(AdapterError, match=r"'a1'.*rank 8"):
        read_adapter(LoraRef("a1", str(adapters["a1"])), 4)


# -- 4. the OpenAI routes ---------------------------------------------------------------------

def completion_texts(url: str, **body) -> list[str]:
    r = post(url, "/v1/completions", {"model": SERVED, "prompt": PROMPTS, "temperature": 0, "ignore_eos": True,
                                      "max_tokens": 8, **body})
    assert r.status_code == 200, r.text
    return [c["text"] for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def test_openai_completions_pick_the_adapter_by_model_suffix_which_wins_over_lora_path(server):
    by_model = completion_texts(server, model=f"{SERVED}:a1")
    assert by_model == completion_texts(server, lora_path="a1")
    assert by_model != completion_texts(server)
    assert completion_texts(server, model="x:a1", lora_path="a2") == by_model
    assert "a9" in error_message(post(server, "/v1/completions", {"model": f"{SERVED}:a9", "prompt": "hi"}))


def test_openai_chat_runs_an_adapter(server):
    def chat(**body) -> str:
        r = post(server, "/v1/chat/completions", {"model": SERVED, "messages": [{"role": "user", "content": "hi"}],
                                                  "temperature": 0, "max_tokens": 6, **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["message"]["content"]

    before = server_info(server).get("lora_requests_a2", 0)
    assert chat(model=f"{SERVED}:a2") == chat(lora_path="a2")
    assert server_info(server)["lora_requests_a2"] == before + 2  # both ran on a2


# -- 5. per-prompt adapters in one /generate --------------------------------------------------

def test_a_batch_takes_an_adapter_per_prompt(server):
    got = outputs(generate(server, [PROMPTS[1]] * 3, [None, "a1", "a2"]))
    assert len(got) == 3
    assert got[0] == outputs(generate(server, PROMPTS[1]))[0]
    assert got[1] == outputs(generate(server, PROMPTS[1], "a1"))[0]
    assert got[2] == outputs(generate(server, PROMPTS[1], "a2"))[0]


# -- 6. the prefix cache is per adapter -------------------------------------------------------

def test_the_prefix_cache_is_not_shared_across_adapters(server):
    ids = [(7 * i + 500) % 1024 for i in range(3 * SERVER_PAGE_SIZE)]  # 3 pages, not sent before

    def cached(lora: str | None) -> int:
        r = generate(server, ids, lora, max_new_tokens=1)
        assert r.status_code == 200, r.text
        return r.json()["meta_info"]["cached_tokens"]

    assert cached("a1") == 0
    assert cached("a1") >= 2 * SERVER_PAGE_SIZE
    assert cached("a2") == 0
    assert cached(None) == 0


# -- 7. the figures -----------------------------------------------------------------------------

def test_metrics_and_server_info_count_by_adapter(server):
    text = requests.get(server + "/metrics", timeout=10).text
    line = re.search(r'^radixrt:lora_requests(?:_total)?\{[^}]*adapter="a1"[^}]*\} (\S+)$', text, re.MULTILINE)
    assert line and float(line.group(1)) > 0, [x for x in text.splitlines() if "lora" in x]
    info = server_info(server)
    # get_server_info flattens the per-adapter figures (as the per-tenant ones): lora_requests_<adapter>
    assert info["lora_adapters"] == 2 and info["lora_requests_a1"] > 0 and "lora_pool_bytes" in info, info
    rows = requests.get(server + "/cache_report", timeout=10).json()["lora_adapters"]  # hit rate per adapter
    assert rows["a1"]["requests"] > 0 and 0 < rows["a1"]["hit_rate"] < 1, rows


# -- 8. last: nothing leaked ------------------------------------------------------------------

def test_the_server_is_idle_with_no_page_leak(server):
    assert_healthy_and_idle(server)

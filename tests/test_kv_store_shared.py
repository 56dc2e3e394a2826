"""One Mooncake Store shared by two servers (issue 56): a prefix computed on one is loaded on
the other with the same greedy tokens, counted as SGLang's storage hits; namespaces and
weights never read each other's pages; and the store is a cache, not a dependency (a value
cut short, a full store, its master killed and restarted): tokens unchanged, no page leaked.

A master on loopback serves the module, killed and restarted by the last test."""

from __future__ import annotations

import concurrent.futures
import shutil
import threading
import time
import urllib.request

import pytest
import requests
from safetensors.torch import load_file, save_file
from support.helpers import corpus_ids, wait_for
from support.mooncake import Master
from support.server_proc import assert_healthy_and_idle, running_server, server_info

from radixrt.cache.tier_index import page_keys
from radixrt.messages import disk_page_name
from radixrt.namespace import DEFAULT_NAMESPACE
from radixrt.ops.prom import Scrape
from radixrt.worker.store_pages import unpack_value

PAGE = 16
# every page the store holds is read back, whatever it costs: on the tiny model recomputing a page
# can be cheaper than a loaded CI machine's store round trip, and these tests are about the store
FLAGS = ("--page-size", str(PAGE), "--max-total-tokens", "2048", "--enable-metrics", "--hicache-disk-max-errors", "2",
         "--hicache-load-policy", "always")
TOKENS = 8


@pytest.fixture(scope="module")
def master():
    m = Master().start()
    yield m
    m.kill()


@pytest.fixture(scope="module")
def servers(master, llama_path):
    with running_server(llama_path, *FLAGS, *master.flags()) as (a, _), \
            running_server(llama_path, *FLAGS, *master.flags()) as (b, _):
        yield a, b


@pytest.fixture(scope="module")
def docs(llama_path) -> list[list[int]]:
    ids = corpus_ids(llama_path)
    return [ids[i * 1000 : i * 1000 + 300] for i in range(1, 9)]


def ask(url: str, ids: list[int], **extra) -> tuple[list[int], int, dict | None]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": TOKENS, "temperature": 0},
            "return_cached_tokens_details": True, **extra}
    r = requests.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    meta = r.json()["meta_info"]
    return r.json()["output_ids"], meta["cached_tokens"], meta["cached_tokens_details"]


def listing(master: Master, what: str) -> set[str]:
    """What the master's admin service lists."""
    with urllib.request.urlopen(f"http://127.0.0.1:{master.metrics_port}/{what}", timeout=10) as r:
        return set(r.read().decode().split())


def stored_keys(master: Master) -> set[str]:
    return listing(master, "get_all_keys")


def segments(master: Master) -> set[str]:
    """The memory segments clients lend the store (one per server worker)."""
    return listing(master, "get_all_segments")


def test_a_prefix_computed_on_one_server_is_loaded_on_the_other(servers, docs):
    a, b = servers
    cold, cached, details = ask(a, docs[0])
    assert cached == 0 and details is None  # SGLang's: no detail without a hit
    got, cached, details = ask(b, docs[0])
    assert got == cold
    assert details["storage"] >= 256 and details["storage_backend"] == "mooncake", details
    assert cached == details["device"] + details["host"] + details["storage"]
    metrics = Scrape.parse(requests.get(b + "/metrics", timeout=10).text)
    assert metrics.value("sglang:cached_tokens_total", cache_source="storage_mooncake") >= 256
    assert server_info(b)["disk_hit_pages"] >= 16
    for url in servers:
        assert_healthy_and_idle(url)


def test_namespaces_that_concatenate_alike_share_no_stored_page(servers, docs, master):
    a, b = servers
    before = stored_keys(master)
    first, _, _ = ask(a, docs[1], cache_salt="ab", extra_key="c")
    mine = stored_keys(master) - before
    assert len(mine) >= 16
    got, cached, _ = ask(b, docs[1], cache_salt="a", extra_key="bc")  # "abc" too, joined
    assert got == first and cached == 0
    assert not (stored_keys(master) - before - mine) & mine  # b's pages are other keys
    got, _, details = ask(b, docs[1], cache_salt="ab", extra_key="c")  # the same namespace does share
    assert got == first and details["storage"] >= 256
    for url in servers:
        assert_healthy_and_idle(url)


def test_other_weights_read_nothing_the_old_ones_stored(servers, docs, master, llama_path, tmp_path):
    a, _ = servers
    first, _, _ = ask(a, docs[2])
    other = tmp_path / "other"
    shutil.copytree(llama_path, other)
    (weights,) = other.glob("*.safetensors")
    tensors = load_file(weights)
    name = next(n for n in tensors if n.endswith("mlp.down_proj.weight"))
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, weights, metadata={"format": "pt"})
    with running_server(other, *FLAGS, *master.flags()) as (c, _):
        _, cached, details = ask(c, docs[2])
        assert cached == 0 and details is None
        prefixes = {key.split("/")[1] for key in stored_keys(master) if key.startswith("radixrt/")}
        assert len(prefixes) == 2, prefixes  # one fingerprint per weights
        assert_healthy_and_idle(c)
    assert len(segments(master)) == 2  # c's worker gave back the memory it lent as it stopped


def whole(value: bytes) -> bool:
    try:
        return bool(unpack_value(value))
    except OSError:
        return False


def test_a_value_cut_short_is_recomputed_with_the_same_tokens(servers, docs, master):
    a, b = servers
    want, _, _ = ask(a, docs[3])
    client = Master.client(master)
    page = disk_page_name(page_keys(docs[3], PAGE, DEFAULT_NAMESPACE.encoded)[5])  # the sixth page's
    (victim,) = wait_for(lambda: [key for key in stored_keys(master) if key.endswith(page)], bool, timeout=10)
    value = client.get(victim)
    assert client.upsert(victim, value[: len(value) // 2]) == 0
    errors = server_info(b)["disk_tier_errors"]
    got, _, details = ask(b, docs[3])
    assert got == want
    info = server_info(b)
    assert info["disk_tier_errors"] > errors, info
    # the damaged value was dropped for every server, and b's recomputed page put in its place
    assert wait_for(lambda: whole(client.get(victim)), bool, timeout=10)
    for url in servers:
        assert_healthy_and_idle(url)


def test_a_full_store_costs_recomputation_only(llama_path, docs):
    small = Master().start()  # its own store: the least memory Mooncake takes, 16 MiB (16384 tokens here)
    ids = corpus_ids(llama_path)
    long_docs = [ids[i * 800 : i * 800 + 1000] for i in range(20)]  # 20000 tokens: the store evicts
    try:
        with running_server(llama_path, *FLAGS, *small.flags(segment_bytes=16 << 20)) as (url, _):
            want = [ask(url, doc)[0] for doc in long_docs]
            assert [ask(url, doc)[0] for doc in long_docs[:6]] == want[:6]  # their pages evicted first
            info = server_info(url)
            assert len(stored_keys(small)) <= 1024 < info["pages_h2disk"], info  # more was sent than it held
            assert_healthy_and_idle(url)
    finally:
        small.kill()


def test_the_master_killed_mid_load_and_restarted(servers, docs, master):
    a, b = servers
    want = [ask(a, doc)[0] for doc in docs[4:8]]
    stop = threading.Event()

    def kill_soon():
        time.sleep(0.05)
        master.kill()
        stop.set()

    killer = threading.Thread(target=kill_soon)
    killer.start()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda doc: ask(b, doc)[0], docs[4:8]))
    killer.join()
    assert got == want  # loaded, or recomputed where the store was gone
    assert [ask(b, doc)[0] for doc in docs[4:8]] == want
    for url in servers:
        assert_healthy_and_idle(url)
    master.start()  # an empty store: both servers rejoin, and share again
    again = docs[0][:100] + docs[5][:200]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        first, _, _ = ask(a, again)
        got, _, details = ask(b, again)
        assert got == first
        if details is not None and details["storage"] > 0:
            break
        again = again[1:] + again[:1]  # a new prompt: nothing of it cached anywhere
        time.sleep(1)
    else:
        pytest.fail(f"the servers did not share through the restarted master: {server_info(b)}")
    assert wait_for(lambda: server_info(b)["disk_tier_enabled"], bool, timeout=5)
    for url in servers:
        assert_healthy_and_idle(url)

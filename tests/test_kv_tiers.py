"""The KV memory tiers below the device pool: content keys, the tier indexes and their
move order, the weights fingerprint, and through the engine and server: token identity
with the hierarchical cache on, loads from host and disk, the disk tier across a
restart, swap preemption, and configurations that cannot work failing at start,
naming the argument."""

from __future__ import annotations

import functools
from pathlib import Path
import random

import pytest
import radixrt
import requests
from support.helpers import assert_no_page_leak, corpus_ids
from radixrt.cache.tier_index import TierIndex, is_page_key, page_keys
from radixrt.kernels.native_build import ISA_ENV, chosen_isa
from radixrt.messages import DISK_PAGE_GLOB, KVMove, MoveKind, disk_page_key, disk_page_name
from radixrt.namespace import DEFAULT_NAMESPACE, CacheNamespace
from radixrt.scheduler.kv_tiers import KVTiers
from support.server_proc import assert_healthy_and_idle, running_server
from support.workloads import cycling_documents
from make_family_models import ensure_family_model

GREEDY = {"max_new_tokens": 8, "temperature": 0}


# -- pure structures ------------------------------------------------------------------


def test_page_keys_chain_over_the_prefix_and_the_namespace():
    rng = random.Random(0)
    tokens = [rng.randrange(1000) for _ in range(100)]
    plain, tenant = DEFAULT_NAMESPACE.encoded, CacheNamespace(salt="tenant-a").encoded
    keys = page_keys(tokens, 16, plain)
    assert len(keys) == 6 and len(set(keys)) == 6 and all(map(is_page_key, keys))
    assert page_keys(tokens[:64], 16, plain) == keys[:4]  # a prefix has the prefix's keys
    assert page_keys(tokens, 16, plain, known=keys[:3]) == keys  # extending equals recomputing
    assert page_keys(tokens, 16, tenant)[0] != keys[0]  # namespaces never share
    assert page_keys(tokens, 16, tenant, known=keys[:3]) == page_keys(tokens, 16, tenant)  # nor extend each other
    other = [tokens[0] + 1] + tokens[1:]
    assert all(a != b for a, b in zip(page_keys(other, 16, plain), keys))  # a key covers all earlier tokens


def test_tier_index_gives_up_leaves_only_in_the_policy_order_with_reservations():
    idx = TierIndex(4)
    idx.put("a", idx.take_free(), None, 0, 4)
    idx.put("b", idx.take_free(), "a", 4, 4)  # b follows a: a is no leaf while b is here
    idx.put("c", idx.take_free(), None, 0, 4)
    idx.get("c")
    assert idx.victim(False) == "b" and not idx.is_leaf("a")
    idx.get("b")  # b now the most recently used: c is the oldest leaf
    assert idx.victim(False) == "c"
    idx.set_pinned("c", True)  # pinned: after every unpinned leaf, and only when asked
    assert idx.victim(False) == "b"
    idx.discard("b")
    assert idx.is_leaf("a") and idx.victim(False) == "a"
    idx.discard("a")
    assert idx.victim(False) is None and idx.victim(True) == "c"
    assert idx.num_free == 3 and "b" not in idx and len(idx) == 1


def kinds(moves: list[KVMove]) -> list[tuple]:
    assert all(type(m.kind) is MoveKind for m in moves)  # a plain string would compare equal too
    return [(m.kind, m.src, m.dst, m.keys) for m in moves]


def execute(t: KVTiers, disk) -> list:
    """Take t's moves and do their file side, as the worker would; returns them as kinds()."""
    moves = t.take_moves()
    for m in moves:
        for key in m.keys:
            path = disk / disk_page_name(key)
            if m.kind is MoveKind.DROP:
                path.unlink()
            elif m.kind in (MoveKind.H2DISK, MoveKind.D2DISK):
                path.write_bytes(b"x")
    return kinds(moves)


def test_host_spills_its_leaves_to_disk_and_disk_drops_its_leaves(tmp_path):
    t = KVTiers(host_pages=2, cache_on_host=True, disk_dir=str(tmp_path), disk_pages=2)
    t.offload(["k1", "k2"], [10, 11], None, 0)  # one sequence: k2 follows k1
    t.offload(["k3"], [12], None, 0)  # host full: its one leaf k2 spills (not k1, the oldest), k3 takes its slot
    t.offload(["k4", "k5"], [13, 14], None, 0)  # k1 then k3 spill; disk full at k3: its leaf k2 is dropped
    assert execute(t, tmp_path) == [
        (MoveKind.D2H, [10, 11], [0, 1], []),
        (MoveKind.H2DISK, [1], [], ["k2"]),
        (MoveKind.D2H, [12], [1], []),
        (MoveKind.H2DISK, [0], [], ["k1"]),
        (MoveKind.D2H, [13], [0], []),
        (MoveKind.DROP, [], [], ["k2"]),
        (MoveKind.H2DISK, [1], [], ["k3"]),
        (MoveKind.D2H, [14], [1], []),
    ]
    assert t.hits(["k1", "k2"]) == 1 and t.hits(["k3"]) == 1 and t.hits(["k4", "k5"]) == 2
    t.load(["k1", "k5"], [20, 21])  # k1 from disk, k5 from host
    assert kinds(t.take_moves()) == [(MoveKind.DISK2D, [], [20], ["k1"]), (MoveKind.H2D, [1], [21], [])]
    assert t.stats()["disk_hit_pages"] == 1 and t.stats()["host_hit_pages"] == 1
    assert t.stats()["unreachable_pages"] == 0


def test_a_page_held_nowhere_takes_the_pages_after_it_along():
    t = KVTiers(host_pages=3, cache_on_host=True)
    on_device = {"a"}
    t.on_device = on_device.__contains__
    t.offload(["b", "c"], [1, 2], "a", 4)  # a stays on the device: b and c are reachable through it
    assert t.unreachable() == []
    t.offload(["x"], [3], None, 0)
    t.offload(["y"], [4], None, 0)  # host full: its leaves are c (oldest) and x; c goes, b stays
    assert t.hits(["b", "c"]) == 1
    on_device.discard("a")
    t.offload(["a"], [0], None, 0)  # a leaves the device for host: the one slot left is a leaf's (b's or x's)
    assert t.unreachable() == [] and t.hits(["a", "b"]) in (1, 2)
    t2 = KVTiers(host_pages=3, cache_on_host=True)
    t2.on_device = {"a"}.__contains__
    t2.offload(["b", "c"], [1, 2], "a", 4)
    t2.on_device = set().__contains__  # a was dropped from the device without going down (a partial page, say)
    t2.offload([], [], None, 0)  # nothing goes down...
    assert sorted(t2.unreachable()) == ["b", "c"]  # ... so b and c are unreachable until a sweep
    assert t2.sweep() == 2 and t2.unreachable() == [] and len(t2.host) == 0


def test_disk_pages_of_an_earlier_run_come_back_in_prefix_order_and_a_removed_file_is_recomputed(tmp_path):
    first, second, third = page_keys([1, 2, 3], 1, DEFAULT_NAMESPACE.encoded)  # files named by page keys
    (orphan,) = page_keys([7, 8], 1, DEFAULT_NAMESPACE.encoded)[1:]  # its first page is not on disk
    for key in (third, second, first, orphan):  # written deepest first: the newest files are the first pages
        (tmp_path / disk_page_name(key)).write_bytes(b"x")
    t = KVTiers(host_pages=2, cache_on_host=True, disk_dir=str(tmp_path), disk_pages=2)  # room for two
    assert kinds(t.take_moves()) == [(MoveKind.DROP, [], [], [third, orphan])]  # the end of the chain, and the orphan
    assert t.disk.keys() == [first, second] and t.disk.parent(second) == first
    (tmp_path / disk_page_name(first)).unlink()  # removed behind the server's back: second goes with it
    assert t.hits([first, second]) == 0 and t.stats()["disk_cached_pages"] == 0
    assert kinds(t.take_moves()) == [(MoveKind.DROP, [], [], [first, second])]
    t.offload(["a", "b", "c"], [1, 2, 3], None, 0)  # c spills to disk: its write is pending, it still counts
    assert t.hits(["a", "b", "c"]) == 3


def test_all_pages_of_one_namespace_are_dropped_from_host_and_disk(tmp_path):
    a, b = CacheNamespace(salt="ab", extra_key="c"), CacheNamespace(salt="a", extra_key="bc")  # "abc" both, joined
    tokens = list(range(16))
    ka, kb = page_keys(tokens, 4, a.encoded), page_keys(tokens, 4, b.encoded)
    t = KVTiers(host_pages=4, cache_on_host=True, disk_dir=str(tmp_path), disk_pages=8, page_size=4)
    t.offload(ka, [0, 1, 2, 3], None, 0)
    t.offload(kb, [4, 5, 6, 7], None, 0)  # a's pages spill to disk, deepest first; b's take host memory
    slots = t.host_tier.swap_out([9])  # spills b's last page; a swapped request's slot is no namespace's
    execute(t, tmp_path)
    assert t.drop_namespace(a) == 4
    assert sorted(execute(t, tmp_path)[0][3]) == sorted(ka)  # their files go
    assert sorted(f.name for f in tmp_path.iterdir()) == [disk_page_name(kb[3])]
    assert t.hits(ka) == 0 and t.hits(kb) == 4  # b's pages stay wherever they were
    assert t.disk.keys() == kb[3:] and t.host.keys_of(b.encoded) == kb[:3] and t.host.keys_of(a.encoded) == []
    assert t.drop_namespace(a) == 0 and t.take_moves() == []
    t.host_tier.swap_in(slots, [9])  # the reserved slot was not freed under the swapped request
    assert t.stats()["host_swap_pages"] == 0 and t.stats()["unreachable_pages"] == 0


def test_disk_page_files_of_an_older_key_format_are_removed_never_adopted(tmp_path, caplog):
    (current,) = page_keys(list(range(4)), 4, DEFAULT_NAMESPACE.encoded)
    old = "0123456789abcdef-0123456789abcdef0123456789abcdef"  # namespaced, without a parent ref (before issue 33)
    for name in (disk_page_name(old), disk_page_name(old, rank=1), disk_page_name(current)):
        (tmp_path / name).write_bytes(b"x")
    with caplog.at_level("WARNING"):
        t = KVTiers(host_pages=2, cache_on_host=True, disk_dir=str(tmp_path), disk_pages=4)
    assert t.disk.keys() == [current] and t.hits([old]) == 0
    assert kinds(t.take_moves()) == [(MoveKind.DROP, [], [], [old])]  # on every rank (the worker names its files)
    assert "1 page files of an older key format" in caplog.text


def test_swap_reserves_host_slots_that_the_cache_cannot_take():
    t = KVTiers(host_pages=3, cache_on_host=True)
    t.offload(["a", "b"], [1, 2], None, 0)
    slots = t.host_tier.swap_out([5, 6])  # takes the free slot, then the leaf b's (no disk: dropped; a stays reachable)
    assert sorted(slots) == [1, 2] and t.hits(["a", "b"]) == 1
    t.offload(["c"], [7], None, 0)  # the one unreserved slot is a's: a goes, c comes
    assert t.hits(["a"]) == 0 and t.hits(["c"]) == 1
    assert t.host_tier.swap_out([1, 2, 3]) is None  # only one slot is not reserved
    t.take_moves()
    t.host_tier.swap_in(slots, [8, 9])
    assert kinds(t.take_moves()) == [(MoveKind.H2D, slots, [8, 9], [])]
    assert t.stats()["host_swap_pages"] == 0


def test_pinned_pages_go_last_spill_but_are_never_dropped(tmp_path):
    t = KVTiers(host_pages=2, cache_on_host=True)
    t.pinned = {"p"}
    t.offload(["p"], [1], None, 0)
    t.offload(["u"], [2], None, 0)
    t.offload(["v"], [3], None, 0)  # host full: u goes, though p is older
    assert t.hits(["p"]) == 1 and t.hits(["u"]) == 0
    t.pinned = {"p", "v"}
    t.set_pinned("v", True)
    t.offload(["w"], [4], None, 0)  # only pinned pages left and no disk: w is not kept, nothing is dropped
    assert t.hits(["p"]) == 1 and t.hits(["v"]) == 1 and t.hits(["w"]) == 0
    d = KVTiers(host_pages=1, cache_on_host=True, disk_dir=str(tmp_path), disk_pages=1)
    d.pinned = {"p"}
    d.offload(["p"], [1], None, 0)
    d.offload(["u"], [2], None, 0)  # a disk below: the pinned page spills to it
    assert d.disk.keys() == ["p"] and d.host.keys() == ["u"]
    d.offload(["v"], [3], None, 0)  # the disk holds only a pinned page: u cannot go there, and is dropped
    assert d.disk.keys() == ["p"] and d.host.keys() == ["v"]


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_each_write_policy_writes_to_host_when_sglang_does(policy):
    from radixrt.scheduler.kv_memory import KVMemory
    from radixrt.scheduler.req import Req
    from radixrt.sampling_params import SamplingParams

    mem = KVMemory(16, 4, tiers=KVTiers(8, True, page_size=4, write_policy=policy))

    def run(rid: str) -> Req:
        r = Req(rid, list(range(9)), SamplingParams(max_new_tokens=1))
        m = mem.match(r)
        assert mem.admit(r, m, r.prompt_len - m.matched_len, 0)
        mem.grow(r, r.prompt_len - r.kv.kv_len)
        mem.advance(r, r.prompt_len - r.kv.kv_len)
        mem.release(r)
        return r

    written = []
    for rid in ("first", "second", "third"):
        run(rid)
        written.append(mem.tiers.log.counters["pages_d2h"])
    # write_through: the two full pages as soon as they are cached; selective: at the second hit (the third
    # request's match); write_back: only on eviction, which never happens here
    assert written == {"write_through": [2, 2, 2], "write_through_selective": [0, 0, 2], "write_back": [0, 0, 0]}[policy]
    assert mem.tiers.stats()["unreachable_pages"] == 0


def test_the_worker_store_runs_every_move_kind_on_whole_pages(tmp_path):
    """Every MoveKind through the worker's KVTierStore on CPU (an int8 pool: values and scales)."""
    import torch
    from radixrt.kernels import PagedKVCache
    from radixrt.worker.kv_tiers import KVTierStore

    cache = PagedKVCache(2, 4, 2, 1, 4, torch.float32, torch.device("cpu"), "int8")
    for b in cache.buffers:
        b.copy_(torch.arange(b.numel()).reshape(b.shape) % 100)  # every page different
    store = KVTierStore(cache, host_pages=2, disk_dir=tmp_path, disk_pages=4, rank=1)

    def page(p: int) -> list[torch.Tensor]:
        return [b[p].clone() for b in cache.buffers]

    want0, want1 = page(0), page(1)
    store.run([
        KVMove(MoveKind.D2H, [0], [1]),
        KVMove(MoveKind.H2DISK, [1], keys=["a"]),
        KVMove(MoveKind.D2DISK, [1], keys=["b"]),
        KVMove(MoveKind.DISK2D, [], [2, 3], ["a", "b"]),
        KVMove(MoveKind.H2D, [1], [1]),
        KVMove(MoveKind.DROP, keys=["a"]),
    ])
    for p, want in ((1, want0), (2, want0), (3, want1)):
        assert all(torch.equal(x, y) for x, y in zip(page(p), want)), p
    assert {f.name for f in tmp_path.iterdir()} == {disk_page_name("b", rank=1)}


def test_the_disk_tier_is_keyed_by_the_weights_content_not_their_place(llama_path, tmp_path):
    import shutil

    import torch
    from radixrt.config import ServerArgs
    from radixrt.config_views import TierConfig
    from radixrt.worker.kv_tiers import weights_fingerprint

    def fingerprint(path, **kw):
        args = ServerArgs(model_path=str(path), enable_hierarchical_cache=True, hicache_dir=str(tmp_path / "hc"), **kw)
        (tmp_path / "hc").mkdir(exist_ok=True)
        return weights_fingerprint(TierConfig.of(args), torch.float32)

    copy = tmp_path / "copy"
    shutil.copytree(llama_path, copy)
    assert fingerprint(copy) == fingerprint(llama_path)  # same weights elsewhere: same KV
    assert fingerprint(llama_path, kv_cache_dtype="int8") != fingerprint(llama_path)
    int4 = {fingerprint(llama_path, kv_cache_dtype="int4", kv_cache_rotation=r) for r in ("auto", "off")}
    assert len(int4) == 2 and fingerprint(llama_path, kv_cache_dtype="int8:int4") not in int4  # rotated keys: other bytes
    assert fingerprint(llama_path, page_size=16) != fingerprint(llama_path)
    int8 = {fingerprint(llama_path, quantization="w8a8_int8"), fingerprint(llama_path, torchao_config="int8wo")}
    assert len(int8) == 2 and fingerprint(llama_path) not in int8  # weights quantized at load make other KV
    fp8 = ServerArgs(model_path=str(llama_path), kv_cache_dtype="fp8_e4m3", enable_hierarchical_cache=True,
                     hicache_dir=str(tmp_path / "hc"))
    fp8 = TierConfig.of(fp8)
    assert weights_fingerprint(fp8, torch.float32, [0.01, 0.02]) != weights_fingerprint(fp8, torch.float32, [0.01, 0.03])
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2 + 12345] ^= 1  # one bit of one weight
    weights.write_bytes(bytes(data))
    assert fingerprint(copy) != fingerprint(llama_path)


# -- through the engine ------------------------------------------------------------------


def run_documents(engine, groups, passes=2, metas=None):
    """Document by document; every other pass backwards, so the recent documents are in
    host memory and the older ones on disk (a forward cycle always misses an LRU tier).
    metas: a list that gets every result's meta_info."""
    out = []
    for p in range(passes):
        for prompts in groups if p % 2 == 0 else groups[::-1]:
            results = engine.generate(input_ids=prompts, sampling_params=GREEDY)
            out.append([r["output_ids"] for r in results])
            if metas is not None:
                metas += [r["meta_info"] for r in results]
    return out


def tier_split(metas) -> dict[str, int]:
    """The cached tokens of these results by tier, summed; each result's split adds up to its cached_tokens."""
    total = {"device": 0, "host": 0, "storage": 0}
    for m in metas:
        d = m["cached_tokens_details"]
        assert (d is None) == (m["cached_tokens"] == 0), m  # SGLang: a detail for every hit, with the tiers on
        if d is not None:
            assert d["device"] + d["host"] + d["storage"] == m["cached_tokens"] and d["storage_backend"] == "file", m
            for k in total:
                total[k] += d[k]
    return total


DOC_LEN = 300


@functools.cache
def documents_of(path: Path) -> list:
    return cycling_documents(corpus_ids(path), n_docs=6, doc_len=DOC_LEN, questions=2)


@pytest.fixture(scope="module")
def documents(llama_path):
    return documents_of(llama_path)


def computed_prompt_tokens(info) -> int:
    return info["prompt_tokens"] - info["cached_prompt_tokens"]


# A 768-token device pool holds about two and a half documents of the workload; host memory as
# much again (hicache_ratio 1), the disk the rest: the second pass reaches both.
# hicache_load_policy always: every page the tiers hold is read back, whatever the load-or-recompute
# choice would measure (a page of one token is cheaper to recompute than to read from its own file;
# a slow disk could make page 16 so too): these tests prove restores, tests/test_tier_costs.py the choice.
TIERS = dict(enable_hierarchical_cache=True, hicache_ratio=1.0, hicache_disk_size=0.01, hicache_load_policy="always")
# Each setup, the tiers its second pass must load pages from, and its model family (int4 groups a
# head's elements by 32: llama-tiny's heads are 16 wide, qwen3's 32; its random weights agree with their int4 KV
# below the start-up check's floor, which the test lowers: it proves restores, not precision).
SETUPS = {
    "page16": (dict(page_size=16), ("host", "disk"), "llama"),
    "page1": (dict(page_size=1), ("host", "disk"), "llama"),
    "int8-tp2": (dict(page_size=16, kv_cache_dtype="int8", tp_size=2), ("host", "disk"), "llama"),
    "int4": (dict(page_size=16, kv_cache_dtype="int4", kv_quant_min_agreement=0.0), ("host", "disk"), "qwen3"),
}


@pytest.mark.parametrize("setup", SETUPS)
def test_restored_pages_give_the_tokens_of_a_cold_run(model_paths, tmp_path, monkeypatch, setup):
    """Pages loaded back from host memory, from disk, and from disk after a restart (a new engine
    on the same hicache_dir) give a cold run's greedy tokens, token for token; the counters show
    they were loaded, not recomputed. Each tensor-parallel rank keeps its own KV heads' page files
    (and a quantized pool's scales with them: int8's per token, int4's per 32 elements beside its
    rotated keys)."""
    kwargs, loads, family = SETUPS[setup]
    path = model_paths[family] if family in model_paths else ensure_family_model(family)
    if kwargs.get("kv_cache_dtype") == "int4":
        # The cold run extends whole prompts, the second pass attends over restored pages: other kernel
        # classes, which the start-up measurement may give different variants (decode avx512bf16, extend
        # avx512, cascade avx2 was seen). Their last-bit differences in one layer's output move a later
        # layer's keys across an int4 step and flip a near-tied random-weight token. One variant for
        # every class keeps the comparison about the restore.
        monkeypatch.setenv(ISA_ENV, chosen_isa(32).name)
    documents = documents_of(path)
    args = dict(model_path=str(path), max_total_tokens=768, **kwargs)
    with radixrt.Engine(**args, disable_radix_cache=True) as e:  # the same setup with no cache at all
        cold = run_documents(e, documents)
        cache_off = computed_prompt_tokens(e.get_server_info())
    tiers = dict(TIERS, hicache_dir=str(tmp_path))
    metas: list = []
    with radixrt.Engine(**args, **tiers) as e:
        assert run_documents(e, documents, metas=metas) == cold
        info = e.get_server_info()
        assert_no_page_leak(e)
    assert all(info[f"{tier}_hit_pages"] > 0 for tier in loads), info
    split, page = tier_split(metas), args["page_size"]  # a retracted request loads again: counters may exceed hits
    assert split["host"] <= page * info["host_hit_pages"] and split["storage"] <= page * info["disk_hit_pages"]
    assert split["device"] > 0 and split["host"] > 0 and (split["storage"] > 0 or "disk" not in loads), split
    assert info["pages_d2h"] > 0 and info["pages_h2disk"] > 0 and info["tier_move_seconds"] > 0, info
    assert computed_prompt_tokens(info) < 0.4 * cache_off, (computed_prompt_tokens(info), cache_off)
    files = {f.name for f in tmp_path.glob(f"*/{DISK_PAGE_GLOB}")}
    rank0 = [disk_page_key(f.name) for f in tmp_path.glob(f"*/{disk_page_name('*')}")]
    ranks = range(args.get("tp_size", 1))
    assert rank0 and all(disk_page_name(key, rank=r) in files for key in rank0 for r in ranks)

    metas = []
    with radixrt.Engine(**args, **tiers) as e:  # a restart: device and host memory start empty
        assert run_documents(e, documents, passes=1, metas=metas) == cold[: len(documents)]
        info = e.get_server_info()
        assert_no_page_leak(e)
    # the first document at least comes back whole from disk
    assert info["disk_hit_pages"] >= DOC_LEN // page, info
    assert tier_split(metas)["storage"] >= DOC_LEN // page * page, tier_split(metas)


PREEMPT = {"max_new_tokens": 48, "temperature": 0}


@pytest.fixture(scope="module")
def preemption_case(llama_path):
    """Six requests that outgrow a 448-token pool together, and their tokens from a large pool."""
    rng = random.Random(5)
    ids = corpus_ids(llama_path)
    prompts = [ids[s : s + rng.randint(60, 140)] for s in (rng.randrange(len(ids) - 200) for _ in range(6))]
    with radixrt.Engine(model_path=str(llama_path), page_size=16, max_total_tokens=8192) as e:
        return prompts, [r["output_ids"] for r in e.generate(input_ids=prompts, sampling_params=PREEMPT)]


@pytest.mark.parametrize("mode", ["swap", "recompute", "auto"])
def test_a_pool_too_small_for_the_batch_completes_by_preemption(llama_path, preemption_case, mode):
    prompts, want = preemption_case
    params = PREEMPT
    with radixrt.Engine(model_path=str(llama_path), page_size=16, max_total_tokens=448, preemption_mode=mode,
                        swap_space=0.01, swap_min_tokens=130) as e:
        got = [r["output_ids"] for r in e.generate(input_ids=prompts, sampling_params=params)]
        info = e.get_server_info()
        assert_no_page_leak(e)
    assert got == want
    assert info["retractions"] > 0
    if mode == "recompute":
        assert info["swaps_out"] == 0 and info["recomputed_tokens"] > 0
    else:
        assert info["swaps_out"] > 0 and info["swaps_in"] == info["swaps_out"] and info["host_swap_pages"] == 0
    if mode == "swap":
        assert info["recomputed_tokens"] == 0


def test_the_disk_tier_outlives_the_server_for_the_same_model_only(model_paths, tmp_path):
    llama, qwen = model_paths["llama"], model_paths["qwen2"]
    doc = corpus_ids(llama)[:400]
    args = ("--page-size", "16", "--max-total-tokens", "2048", "--enable-hierarchical-cache",
            "--hicache-dir", str(tmp_path), "--hicache-disk-size", "0.01", "--hicache-load-policy", "always")

    def ask(url, question):
        res = requests.post(url + "/generate", json={"input_ids": doc + question, "sampling_params": GREEDY}, timeout=60).json()
        return res, requests.get(url + "/get_server_info", timeout=10).json()

    with running_server(llama, *args) as (url, _):
        first, _ = ask(url, [8, 9])
        assert first["meta_info"]["cached_tokens"] == 0  # a cold run
    with running_server(llama, *args) as (url, _):
        again, info = ask(url, [8, 9])
        assert_healthy_and_idle(url)  # no page leaked
        metrics = requests.get(url + "/metrics", timeout=10).text
        # the document is on the device now; the OpenAI routes say so in sglext when asked
        body = {"prompt": doc + [8, 9], "max_tokens": 1, "return_cached_tokens_details": True}
        completion = requests.post(url + "/v1/completions", json=body, timeout=60).json()
    assert again["output_ids"] == first["output_ids"]  # restored after a restart equals computed
    assert metric(metrics, "radixrt:disk_hit_pages_total") == info["disk_hit_pages"]
    assert metric(metrics, "radixrt:kv_bytes_per_token") == info["bytes_per_token"] > 0
    assert again["meta_info"]["cached_tokens"] >= 384 and info["disk_hit_pages"] >= 24, (again["meta_info"], info)
    storage = 16 * info["disk_hit_pages"]  # loaded from the disk tier, all of it for this one request
    assert again["meta_info"]["cached_tokens_details"] == {
        "device": again["meta_info"]["cached_tokens"] - storage, "host": 0, "storage": storage, "storage_backend": "file"}
    assert metric(metrics, "sglang:cached_tokens_total", 'cache_source="storage_file"') == storage
    details = completion["sglext"]["cached_tokens_details"]
    assert details["device"] == completion["usage"]["prompt_tokens_details"]["cached_tokens"] >= 384, completion
    assert (details["host"], details["storage"], details["storage_backend"]) == (0, 0, "file")
    with running_server(qwen, *args) as (url, _):
        other, info = ask(url, [8, 9])
    assert other["meta_info"]["cached_tokens"] == 0 and info["disk_hit_pages"] == 0


def test_the_scheduler_exits_only_once_its_last_moves_are_written(tmp_path):
    """The moves that write the cache to the disk tier at shutdown, and Shutdown after them, reach
    the ranks although the scheduler's process ends in os._exit at once (as launch/child.py ends
    it): a zmq send only queues. A large cache's moves are megabytes, never written in time
    without waiting for them."""
    import subprocess
    import sys

    import zmq
    from radixrt.ipc import Receiver
    from radixrt.messages import KVMoves, SchedulerToWorker, Shutdown

    to_rank, from_rank = f"ipc://{tmp_path}/to-rank", f"ipc://{tmp_path}/from-rank"
    n = 50_000  # page keys: about 2 MB of moves
    scheduler = f"""if True:
        import os, sys
        sys.path[:] = {sys.path!r}  # as launch/child.py imports: the modules this test imports
        import zmq
        from radixrt.ipc import Receiver, Sender
        from radixrt.messages import KVMove, MoveKind, WorkerToScheduler
        from radixrt.scheduler.scheduler_proc import Ranks, stop_ranks
        ctx = zmq.Context()
        ranks = Ranks([Sender(ctx, {to_rank!r}, bind=True, timeout_ms=20000)],
                      Receiver(ctx, {from_rank!r}, WorkerToScheduler), 20.0)
        keys = [f"{{i:040x}}" for i in range({n})]
        stop_ranks(ranks, [KVMove(MoveKind.D2DISK, list(range({n})), keys=keys)], ctx)
        os._exit(0)
    """
    ctx = zmq.Context()
    rank = Receiver(ctx, to_rank, SchedulerToWorker, bind=False)
    try:
        done = subprocess.run([sys.executable, "-c", scheduler], timeout=60, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        got = [rank.recv(timeout_ms=5000), rank.recv(timeout_ms=5000)]
    finally:
        ctx.destroy(linger=0)
    assert isinstance(got[0], KVMoves) and got[0].moves[0].keys == [f"{i:040x}" for i in range(n)], "the moves were lost"
    assert isinstance(got[1], Shutdown), "the ranks were never told to stop"


def metric(text: str, name: str, label: str = "") -> float:
    """The value of name's sample (with label among its labels, when given)."""
    return float(next(line.split()[-1] for line in text.splitlines()
                      if line.startswith(name + " ") or label and line.startswith(name + "{") and label in line))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"enable_hierarchical_cache": True, "hicache_size": 100000}, "hicache_size"),
        ({"preemption_mode": "swap", "swap_space": 100000}, "swap_space"),
        ({"enable_hierarchical_cache": True, "hicache_dir": "FILE/sub"}, "hicache_dir"),
        ({"enable_hierarchical_cache": True, "hicache_dir": "DIR", "hicache_disk_size": 1e9}, "hicache_disk_size"),
        ({"kv_cache_dtype": "int4"}, "int4 needs head_dim a multiple of 32, not 16"),
        ({"kv_cache_dtype": "fp4_e2m1"}, "fp4_e2m1"),
    ],
)
def test_configurations_that_cannot_work_fail_at_start(llama_path, tmp_path, kwargs, words):
    (tmp_path / "FILE").write_text("not a directory")
    kwargs = {k: v.replace("FILE", str(tmp_path / "FILE")).replace("DIR", str(tmp_path)) if isinstance(v, str) else v
              for k, v in kwargs.items()}
    with pytest.raises((RuntimeError, ValueError), match=words):
        radixrt.Engine(model_path=str(llama_path), max_total_tokens=1024, **kwargs)

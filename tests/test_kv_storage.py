"""--hicache-storage-backend (issue 56), without a model: the flags and settings as SGLang 0.5.9
reads them, the stored values' header, and the worker's and the scheduler's clients against a
real mooncake_master on loopback (killed and restarted: the tier turns off, then rejoins)."""

from __future__ import annotations

import argparse
import errno
import json
from pathlib import PurePosixPath

import pytest
import torch
from support.helpers import wait_for
from support.mooncake import Master

from radixrt import kv_storage
from radixrt.cli_args import add_server_args, server_args_from
from radixrt.config import ServerArgs
from radixrt.kernels import PagedKVCache
from radixrt.launch.replicas import replica_args, server_flags
from radixrt.messages import DiskFaults, KVMove, MoveKind, disk_page_name
from radixrt.scheduler import disk_files
from radixrt.scheduler.disk_files import StoreView
from radixrt.scheduler.kv_tiers import KVTiers
from radixrt.settings import hicache
from radixrt.settings.hicache import MooncakeSettings, parse_extra_config, parse_size
from radixrt.worker import disk_tier
from radixrt.worker.disk_tier import DiskTier
from radixrt.worker.kv_tiers import KVTierStore
from radixrt.worker.store_pages import HEADER, StorePages, pack_value, unpack_value

GB = 2**30


def kinds(moves: list[KVMove]) -> list[tuple]:
    return [(m.kind, m.src, m.dst, m.keys) for m in moves]


def args(**kw) -> ServerArgs:
    return ServerArgs(model_path="m", enable_hierarchical_cache=True, **kw)


# -- flags and settings ---------------------------------------------------------------------------


def test_the_extra_config_is_json_or_a_json_yaml_or_toml_file(tmp_path):
    assert parse_extra_config(None) == {} and parse_extra_config('{"a": 1}') == {"a": 1}
    for name, text in (("c.json", '{"a": 1}'), ("c.yaml", "a: 1\n"), ("c.toml", "a = 1\n")):
        (tmp_path / name).write_text(text)
        assert parse_extra_config(f"@{tmp_path / name}") == {"a": 1}
    for bad in ("{nope", "[1, 2]", f"@{tmp_path / 'missing.json'}"):
        with pytest.raises(ValueError, match="hicache_storage_backend_extra_config"):
            parse_extra_config(bad)


def test_mooncake_settings_come_from_the_extra_config_then_sglangs_file_then_the_environment(tmp_path):
    env = {"MOONCAKE_MASTER": "10.0.0.1:1", "MOONCAKE_PROTOCOL": "rdma", "MOONCAKE_GLOBAL_SEGMENT_SIZE": "2gb",
           "MOONCAKE_DEVICE": "mlx5_0", "LOCAL_HOSTNAME": "me"}
    s = MooncakeSettings.resolve({}, env)
    assert (s.master, s.protocol, s.global_segment_size, s.device, s.local_hostname) == ("10.0.0.1:1", "rdma", 2 * GB,
                                                                                          "mlx5_0", "me")
    assert s.metadata_server == "P2PHANDSHAKE"  # SGLang's default
    (tmp_path / "mc.json").write_text(json.dumps({"master_server_address": "10.0.0.2:2", "protocol": "tcp"}))
    s = MooncakeSettings.resolve({}, {**env, hicache.CONFIG_PATH_ENV: str(tmp_path / "mc.json")})
    assert (s.master, s.protocol, s.global_segment_size) == ("10.0.0.2:2", "tcp", 4 * GB)  # the file, then defaults
    s = MooncakeSettings.resolve({"master_server_address": "10.0.0.3:3", "global_segment_size": 1 << 20}, env)
    assert (s.master, s.global_segment_size, s.protocol) == ("10.0.0.3:3", 1 << 20, "tcp")
    with pytest.raises(ValueError, match="MOONCAKE_MASTER"):
        MooncakeSettings.resolve({}, {})
    with pytest.raises(ValueError, match="client_server_address alone"):
        MooncakeSettings.resolve({"client_server_address": "10.0.0.4:4"}, {})
    assert parse_size("4gb") == 4 * GB and parse_size(" 7 ") == 7
    with pytest.raises(ValueError, match="global_segment_size"):
        parse_size("4mb")


def test_the_backend_flags_mean_what_sglang_means(monkeypatch):
    monkeypatch.setenv(hicache.FILE_DIR_ENV, "/var/tmp/kv")
    assert args(hicache_storage_backend="file").hicache_dir == "/var/tmp/kv"  # SGLang's HiCacheFile directory
    assert args(hicache_storage_backend="file", hicache_dir="/d").hicache_dir == "/d"
    monkeypatch.delenv(hicache.FILE_DIR_ENV)
    assert args(hicache_storage_backend="file").hicache_dir == "/tmp/hicache"
    assert args(hicache_storage_backend="file").storage_backend == "file" and args().storage_backend is None
    monkeypatch.setenv("MOONCAKE_MASTER", "127.0.0.1:9")
    a = args(hicache_storage_backend="mooncake", hicache_storage_prefetch_policy="timeout",
             hicache_storage_backend_extra_config='{"prefetch_timeout_base": 0.5}')
    assert a.mooncake.master == "127.0.0.1:9" and a.storage_backend == "mooncake"
    assert a.prefetch_timeout == (0.5, 0.25) and args(hicache_storage_backend="mooncake").prefetch_timeout is None
    refusals = [({"hicache_storage_backend": "hf3fs"}, "SGLang's, not supported here"),
                ({"hicache_storage_backend": "s3"}, "must be one of"),
                ({"hicache_storage_backend": "mooncake", "hicache_dir": "/d"}, "live in the store"),
                ({"hicache_storage_backend": "file", "hicache_storage_prefetch_policy": "soon"}, "prefetch_policy")]
    for kw, message in refusals:
        with pytest.raises(ValueError, match=message):
            args(**kw)
    with pytest.raises(ValueError, match="add enable_hierarchical_cache"):
        ServerArgs(model_path="m", hicache_storage_backend="file")


def test_a_stored_value_that_is_not_whole_reads_as_an_io_error():
    value = pack_value([b"abc", b"defg"])
    assert unpack_value(value) == b"abcdefg" and len(value) == HEADER.size + 7
    damaged = [value[:-1], value[: HEADER.size - 1], value[:-1] + b"X", b"nope" + value[4:]]
    for bad in damaged:
        with pytest.raises(OSError) as e:
            unpack_value(bad)
        assert e.value.errno == errno.EIO


# -- against a real master ------------------------------------------------------------------------


@pytest.fixture()
def master():
    m = Master().start()
    yield m
    m.close_clients()
    m.kill()


def settings(m: Master, segment: int = 16 << 20) -> MooncakeSettings:
    return MooncakeSettings.resolve(json.loads(m.extra_config(segment)))


def test_pages_go_to_the_store_and_come_back_and_a_corrupt_one_is_an_io_error(master):
    pages = master.keep(StorePages(settings(master), 16 << 20))
    path = PurePosixPath("radixrt/fp") / disk_page_name("k")
    pages.write(path, [b"x" * 1000, b"y" * 24])
    assert pages.read(path) == b"x" * 1000 + b"y" * 24
    pages.remove(path)
    with pytest.raises(OSError) as e:
        pages.read(path)
    assert e.value.errno == errno.ENOENT
    assert pages.store.put(str(path), pack_value([b"z" * 64])[:-10]) == 0  # cut short by someone else
    with pytest.raises(OSError) as e:
        pages.read(path)
    assert e.value.errno == errno.EIO


def test_a_tier_whose_master_dies_turns_off_and_comes_back_when_it_is_restarted(master, monkeypatch, caplog):
    monkeypatch.setattr(disk_tier, "RETRY_SECONDS", 0.0)
    pages = master.keep(StorePages(settings(master), 16 << 20))
    tier = DiskTier(PurePosixPath("radixrt/fp"), 8, 0, 16, max_errors=2, files=pages)
    tier.write("a", [b"p" * 16])
    assert tier.read("a", 3) == b"p" * 16
    tier.settle(tier.outcomes())
    master.kill()
    assert tier.read("a", 4) is None  # the master is gone: the page is lost, not the worker
    tier.write("b", [b"q" * 16])
    tier.settle(tier.outcomes())
    faults = tier.take_faults()
    assert faults.lost_pages == [4] and faults.disabled and not tier.enabled and faults.errors == 2
    assert "Mooncake store KV tier" in caplog.text and "is off" in caplog.text
    master.start()  # a restarted master: the client mounts its memory again, and the tier is on, empty
    faults = wait_for(tier.take_faults, lambda f: tier.enabled, timeout=30)
    assert tier.enabled and faults.rejoined and not faults.disabled
    tier.write("c", [b"r" * 16])
    assert tier.read("c", 5) == b"r" * 16 and tier.read("a", 6) is None  # the old master's pages are gone


def test_a_worker_that_finds_no_master_starts_with_its_tier_off(monkeypatch):
    m = Master()  # never started
    pages = StorePages(settings(m), 16 << 20)
    assert pages.store is None and not pages.healthy()
    with pytest.raises(OSError) as e:
        pages.read(PurePosixPath("radixrt/x"))
    assert e.value.errno == errno.ENOTCONN


def test_the_scheduler_sees_every_servers_pages_and_none_while_the_master_is_down(master, monkeypatch):
    monkeypatch.setattr(disk_files, "MEMO_SECONDS", 0.0)
    monkeypatch.setattr(disk_files, "RETRY_SECONDS", 0.0)
    writer = master.keep(StorePages(settings(master), 16 << 20))
    writer.write(PurePosixPath("radixrt/fp") / disk_page_name("k1"), [b"v"])
    view = master.keep(StoreView(settings(master), "radixrt/fp"))
    assert view.connector.client() is not None
    assert view.has("k1") and not view.has("k2") and view.adoptable() == [] and view.shared
    other = master.keep(StoreView(settings(master), "radixrt/other"))
    assert other.connector.client() is not None and not other.has("k1")  # another fingerprint reads nothing
    master.kill()
    assert not view.has("k1")  # a cache: down means a miss
    master.start()
    assert not view.has("k1")  # the restarted master does not know the old page
    assert wait_for(writer.healthy, bool, timeout=30)  # the writer's memory mounted again
    writer.write(PurePosixPath("radixrt/fp") / disk_page_name("k1"), [b"v"])
    assert view.has("k1")


def test_the_memo_asks_the_store_once_per_key_while_it_stands(master):
    view = master.keep(StoreView(settings(master), "radixrt/fp"))
    view.prepare(["a", "b"])
    asked, real = [], view.connector.client()

    class Counting:
        def batch_is_exist(self, names):
            asked.append(names)
            return real.batch_is_exist(names)

    view.connector._client = Counting()
    view.prepare(["a", "b", "c"])
    view.connector._client = real
    assert not view.has("a") and len(asked) == 1 and len(asked[0]) == 1 and asked[0][0].endswith(disk_page_name("c"))


# -- the scheduler's index over a shared store ---------------------------------------------------


class FakeStore:
    """What a shared store holds, by page key (StoreView's has/prepare)."""

    shared = True

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def adoptable(self) -> list[str]:
        return []

    def prepare(self, keys: list[str]) -> None:
        pass

    def has(self, key: str) -> bool:
        return key in self.keys

    def forget(self, keys: list[str]) -> None:
        self.keys -= set(keys)


def shared_tiers(host_pages: int = 2, disk_pages: int = 2) -> tuple[KVTiers, FakeStore]:
    t = KVTiers(host_pages, True, "radixrt/fp", disk_pages, write_policy="write_through",
                store=MooncakeSettings.resolve({"master_server_address": "127.0.0.1:1"}))
    assert isinstance(t.disk_tier.view, StoreView) and t.disk_tier.shared
    t.disk_tier.view = FakeStore()
    return t, t.disk_tier.view


def test_a_shared_store_gets_each_cached_page_at_once_and_gives_another_servers_pages_back():
    t, store = shared_tiers()
    t.offload(["k1", "k2"], [10, 11], None, 0, write=True)  # written through: host, then the store
    assert kinds(t.take_moves()) == [(MoveKind.D2H, [10], [0], []), (MoveKind.H2DISK, [0], [], ["k1"]),
                                     (MoveKind.D2H, [11], [1], []), (MoveKind.H2DISK, [1], [], ["k2"])]
    store.keys |= {"k1", "k2", "o1", "o2"}  # o1, o2: another server's
    assert t.hits(["o1", "o2", "o3"]) == 2 and t.sources(["o1", "o2"]) == [MoveKind.DISK2D] * 2
    t.touch(["o1", "o2"])
    assert t.load(["o1", "o2"], [20, 21]).disk_pages == 2
    assert kinds(t.take_moves()) == [(MoveKind.DISK2D, [], [20, 21], ["o1", "o2"])]
    assert "o1" not in t.disk  # the index holds what this server wrote; the store answers for the rest


def test_a_shared_store_keeps_what_this_server_forgets_and_loses_only_what_is_purged():
    t, store = shared_tiers(host_pages=1, disk_pages=1)
    t.offload(["a"], [1], None, 0, write=True)
    t.offload(["b"], [2], None, 0, write=True)  # host and index full: a's index entry goes, the store keeps it
    assert MoveKind.DROP not in [m.kind for m in t.take_moves()]
    store.keys |= {"a", "b"}
    assert t.hits(["a"]) == 1  # found again
    store.keys.discard("b")  # evicted by the store: the index lets it go, without a move
    t.host.discard("b")
    t.links.left("b", None)
    assert t.hits(["b"]) == 0 and "b" not in t.disk and t.take_moves() == []
    t.disk_tier.persist([("c", None, 0, 3)])  # at shutdown nothing is left to write: pages went as they were cached
    assert t.take_moves() == []
    t.offload(["n"], [4], None, 0, write=True)
    t.take_moves()
    t.disk_tier.failed(DiskFaults(lost_keys=["n"], errors=1))  # a value that failed to read: removed for everyone
    assert kinds(t.take_moves()) == [(MoveKind.DROP, [], [], ["n"])]


def test_a_store_that_turns_off_forgets_its_index_and_a_store_that_answers_again_starts_a_new_one():
    t, _ = shared_tiers()
    t.offload(["a"], [1], None, 0, write=True)
    t.take_moves()
    t.disk_tier.failed(DiskFaults(errors=8, disabled=True))
    assert t.disk is None and t.disk_tier.view is None and t.hits(["a"]) == 1  # host memory still has it
    t.disk_tier.failed(DiskFaults(rejoined=True))
    assert t.disk is not None and len(t.disk) == 0 and t.disk.capacity == 2 and isinstance(t.disk_tier.view, StoreView)
    assert t.stats()["unreachable_pages"] == 0


def test_dp_size_replicas_are_configured_with_one_store():
    extra = '{"master_server_address": "127.0.0.1:9", "global_segment_size": 1048576}'
    args = ServerArgs(model_path="m", dp_size=2, enable_hierarchical_cache=True, hicache_storage_backend="mooncake",
                      hicache_storage_backend_extra_config=extra, hicache_storage_prefetch_policy="wait_complete")
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    replicas = [server_args_from(parser.parse_args(server_flags(replica_args(args, port, on_cpu=True))))
                for port in (4001, 4002)]
    assert [r.mooncake for r in replicas] == [args.mooncake] * 2 and args.mooncake.global_segment_size == 1 << 20
    assert {r.hicache_storage_prefetch_policy for r in replicas} == {"wait_complete"}


def test_the_timeout_prefetch_policy_recomputes_what_is_not_read_in_time(tmp_path):
    cache = PagedKVCache(2, 8, 2, 1, 4, torch.float32, torch.device("cpu"))
    for b in cache.buffers:
        b.copy_(torch.arange(b.numel()).reshape(b.shape) % 100)
    for bound, lost in (((60.0, 0.0), []), ((0.0, 0.0), [4, 5])):  # SGLang's base + per 1024 tokens
        store = KVTierStore(cache, 2, tmp_path, 8, 0, prefetch_timeout=bound)
        store.run([KVMove(MoveKind.D2DISK, [0, 1], keys=["a", "b"])])
        store.run([KVMove(MoveKind.DISK2D, [], [4, 5], ["a", "b"])])
        store.disk.settle(store.disk.outcomes())
        faults = store.take_faults()
        assert (faults.lost_pages if faults else []) == lost and (faults.errors if faults else 0) == 0


def test_a_missing_client_or_libibverbs_is_named(monkeypatch):
    import builtins

    real = builtins.__import__
    for message, named in (("libibverbs.so.1: cannot open shared object file", "apt-get install libibverbs1"),
                           ("No module named 'mooncake'", "pip install 'radixrt[mooncake]'")):
        def fake(name, *a, message=message, **kw):
            if name.startswith("mooncake"):
                raise ImportError(message)
            return real(name, *a, **kw)

        monkeypatch.setattr(builtins, "__import__", fake)
        with pytest.raises(ImportError, match=named.replace("[", r"\[").replace("]", r"\]")):
            kv_storage.import_store()
        monkeypatch.setattr(builtins, "__import__", real)

"""The disk KV tier is a cache, not a dependency (issue 29): a page file that cannot be written
or read back (a full or read-only disk, its directory removed, a file cut short) costs a
recomputation, never a request or the worker. Failures are counted, a tier that keeps failing
turns itself off, and the scheduler recomputes what a failed read left without KV, with the
same tokens.

Unit tests inject faults through a wrapper of the worker tier's file operations (PageFiles);
the scheduler's bookkeeping runs against the tensor-free FakeWorker; one real server has its
page files damaged and then its directory deleted while it runs."""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import shutil
from pathlib import Path
from typing import Iterable, Iterator

import pytest
import requests
import torch
from support.fake_worker import POISON, FakeWorker, reference_generate
from radixrt.cache import RadixCache
from radixrt.cache.tier_index import page_keys
from radixrt.config import ServerArgs
from radixrt.config_views import SchedulerConfig
from radixrt.kernels import PagedKVCache
from radixrt.messages import BatchResult, DiskFaults, KVMove, MoveKind, disk_page_name
from radixrt.namespace import DEFAULT_NAMESPACE
from radixrt.ops.prom import Scrape
from radixrt.scheduler.scheduler import Scheduler
from radixrt.worker.disk_tier import Outcome, PageFiles
from radixrt.worker.kv_tiers import KVTierStore
from support.server_proc import assert_healthy_and_idle, running_server, server_info
from support.scheduling import CharTokenizer, assert_idle_pool, make, req, run

# -- the worker's tier, with faults injected ------------------------------------------------------


class FaultyFiles(PageFiles):
    """PageFiles whose next operations of a kind fail: faults[kind] is a list of errnos (or
    "short": a read that returns a page cut short), used up one per call."""

    def __init__(self) -> None:
        self.faults: dict[str, list] = {"write": [], "read": [], "remove": []}
        self.calls = 0

    def _fault(self, kind: str) -> int | str | None:
        self.calls += 1
        return self.faults[kind].pop(0) if self.faults[kind] else None

    def write(self, path: Path, chunks: Iterable[bytes]) -> None:
        code = self._fault("write")
        if code is not None:  # after part of the page, as a disk filling up mid-file does
            chunks = _failing(list(chunks), code)
        super().write(path, chunks)

    def read(self, path: Path) -> bytes:
        code = self._fault("read")
        if code == "short":
            data = super().read(path)
            return data[: len(data) // 2]
        if code is not None:
            raise OSError(code, f"injected {errno.errorcode[code]}")
        return super().read(path)

    def remove(self, path: Path) -> None:
        code = self._fault("remove")
        if code is not None:
            raise OSError(code, f"injected {errno.errorcode[code]}")
        super().remove(path)


def _failing(chunks: list[bytes], code: int) -> Iterator[bytes]:
    yield chunks[0][:7]
    raise OSError(code, f"injected {errno.errorcode[code]}")


def store_with(tmp_path: Path, max_errors: int = 8, rank: int = 0) -> tuple[KVTierStore, FaultyFiles]:
    cache = PagedKVCache(2, 8, 2, 1, 4, torch.float32, torch.device("cpu"), "int8")  # values and scales
    for b in cache.buffers:
        b.copy_(torch.arange(b.numel()).reshape(b.shape) % 100)  # every page different
    files = FaultyFiles()
    return KVTierStore(cache, 2, tmp_path, 8, rank, max_errors, files), files


def page(store: KVTierStore, p: int) -> list[torch.Tensor]:
    return [b[p].clone() for b in store.cache.buffers]


def settle(store: KVTierStore) -> DiskFaults | None:
    """What ModelRunner.move does on one rank."""
    store.disk.settle(store.disk.outcomes())
    return store.take_faults()


def test_failed_writes_and_reads_lose_their_pages_and_leave_no_file_behind(tmp_path):
    store, files = store_with(tmp_path)
    files.faults["write"] = [errno.ENOSPC, errno.EROFS]
    store.run([KVMove(MoveKind.D2DISK, [0, 1, 2], keys=["a", "b", "c"])])  # a, b fail; c is written
    assert settle(store) == DiskFaults(lost_keys=["a", "b"], errors=2)
    assert sorted(f.name for f in tmp_path.iterdir()) == [disk_page_name("c")]  # no temporary file either
    store.run([KVMove(MoveKind.D2DISK, [0, 1], keys=["a", "b"])])
    before = [page(store, p) for p in (5, 6, 7)]
    files.faults["read"] = [errno.ENOENT, "short"]
    store.run([KVMove(MoveKind.DISK2D, [], [5, 6, 7], ["a", "b", "c"])])  # a, b fail; c loads
    assert settle(store) == DiskFaults(lost_keys=["a", "b"], lost_pages=[5, 6], errors=2)
    assert all(torch.equal(x, y) for x, y in zip(page(store, 7), page(store, 2)))
    for p, old in zip((5, 6), before):  # a page that could not be read is left as it was
        assert all(torch.equal(x, y) for x, y in zip(page(store, p), old))
    files.faults["remove"] = [errno.EROFS]
    store.run([KVMove(MoveKind.DROP, keys=["c"])])
    assert settle(store) == DiskFaults(errors=1)  # a drop's key is gone from the index already
    assert store.disk.enabled and settle(store) is None


def test_a_page_file_cut_short_on_disk_is_a_miss(tmp_path):
    store, _ = store_with(tmp_path)
    store.run([KVMove(MoveKind.D2DISK, [0], keys=["a"])])
    path = tmp_path / disk_page_name("a")
    path.write_bytes(path.read_bytes()[:-1])
    store.run([KVMove(MoveKind.DISK2D, [], [4], ["a"])])
    assert settle(store) == DiskFaults(lost_keys=["a"], lost_pages=[4], errors=1)


def test_a_tier_failing_again_and_again_turns_itself_off_once(tmp_path, caplog):
    store, files = store_with(tmp_path, max_errors=3)
    files.faults["write"] = [errno.ENOSPC] * 2
    store.run([KVMove(MoveKind.D2DISK, [0, 1, 2], keys=["a", "b", "c"])])  # two failures, then a success
    assert settle(store).errors == 2 and store.disk.enabled
    files.faults["write"] = [errno.EROFS] * 3  # d, e, f fail; g is written, but the tier is off after f
    store.run([KVMove(MoveKind.D2DISK, [0, 1, 2, 3], keys=["d", "e", "f", "g"])])
    faults = settle(store)
    assert faults.disabled and faults.errors == 3 and faults.lost_keys == ["d", "e", "f"]
    calls = files.calls
    store.run([KVMove(MoveKind.DISK2D, [], [4], ["c"]), KVMove(MoveKind.DROP, keys=["a"])])
    assert files.calls == calls, "a tier that is off touches no file"
    assert settle(store) == DiskFaults(lost_keys=["c"], lost_pages=[4])  # not an error: nothing was tried
    off = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(off) == 1 and "is off: 3 page file operations failed in a row" in off[0], off
    assert store.describe()["disk_dir"] == ""


def test_ranks_agree_a_page_lost_on_one_rank_is_lost_on_all(tmp_path):
    (tmp_path / "r0").mkdir()
    (tmp_path / "r1").mkdir()
    ranks = [store_with(tmp_path / f"r{r}", rank=r) for r in (0, 1)]
    for store, _ in ranks:
        store.run([KVMove(MoveKind.D2DISK, [0, 1], keys=["a", "b"])])
        settle(store)
    ranks[1][1].faults["read"] = [errno.EIO]  # rank 1's copy of "a" cannot be read
    for store, _ in ranks:
        store.run([KVMove(MoveKind.DISK2D, [], [4, 5], ["a", "b"])])
    agreed = [max(o) for o in zip(*(store.disk.outcomes() for store, _ in ranks))]  # all_reduce MAX
    assert agreed == [Outcome.FAILED, Outcome.DONE]
    for store, _ in ranks:
        store.disk.settle(agreed)
    assert ranks[0][0].take_faults() == ranks[1][0].take_faults() == DiskFaults(["a"], [4], 1)


def test_the_error_limit_is_checked_at_start():
    with pytest.raises(ValueError, match="hicache_disk_max_errors"):
        ServerArgs(model_path="unused", hicache_disk_max_errors=0)


# -- the scheduler's bookkeeping ------------------------------------------------------------------


def test_forgetting_a_page_cuts_its_node_and_everything_below():
    c = RadixCache(4)
    c.insert(list(range(16)), [1, 2, 3, 4])
    c.insert(list(range(12)) + [9, 9, 9, 9, 8], [1, 2, 3, 5, 6])  # a branch after page 3, and a partial page
    assert sorted(c.forget({3})) == [3, 4, 5, 6]
    assert c.total_pages == c.evictable_pages == 2
    assert c.match_prefix(list(range(16))).pages == [1, 2]


class LossyWorker(FakeWorker):
    """A FakeWorker whose disk reads of the keys in `unreadable` fail on some rank: the device
    page gets garbage (POISON) and the result says so, as ModelRunner's does."""

    def __init__(self, *a, **kw) -> None:
        super().__init__(*a, **kw)
        self.unreadable: set[str] = set()
        self.faults = DiskFaults()

    def move(self, moves: list[KVMove]) -> None:
        for m in moves:
            if m.kind is MoveKind.DISK2D:
                bad = [(k, p) for k, p in zip(m.keys, m.dst) if k in self.unreadable]
                ok = [(k, p) for k, p in zip(m.keys, m.dst) if k not in self.unreadable]
                m = KVMove(MoveKind.DISK2D, [], [p for _, p in ok], [k for k, _ in ok])
                for key, p in bad:
                    self._fill(p, [POISON] * self.page_size)
                    self.faults.lost_keys.append(key)
                    self.faults.lost_pages.append(p)
                    self.faults.errors += 1
            super().move([m])

    def forward(self, batch) -> BatchResult:
        out = super().forward(batch)
        out.disk, self.faults = (self.faults if self.faults.errors else None), DiskFaults()
        return out


def test_a_failed_disk_read_is_recomputed_with_the_same_tokens(tmp_path):
    """Documents pushed through host to disk, then read back, by two requests each, with every
    second disk page unreadable: each request that read one runs again, and every token is the
    reference's."""
    w = LossyWorker(40, 4, host_pages=40, disk_dir=str(tmp_path), disk_pages=200)
    args = ServerArgs(model_path="unused", page_size=4, chunked_prefill_size=256, enable_hierarchical_cache=True)
    s = Scheduler(SchedulerConfig.of(args), w.ready, CharTokenizer())
    docs = [[(7 * d + i) % 45 for i in range(70)] for d in range(6)]
    first = [req(f"a{d}", docs[d] + [d], 5) for d in range(6)]
    assert run(s, w, first)[0] == {r.rid: reference_generate(r.input_ids, 5) for r in first}
    assert s.stats().disk_cached_pages > 0
    w.unreadable = set(list(w.disk)[::2])
    again = [req(f"b{d}{k}", docs[d] + [d, k], 5) for d in range(6) for k in (1, 2)]  # two read each page
    outputs, _ = run(s, w, again)
    assert outputs == {r.rid: reference_generate(r.input_ids, 5) for r in again}
    st = s.stats()
    assert st.disk_tier_errors > 0 and st.recomputed_tokens > 0 and st.disk_tier_enabled == 1
    assert_idle_pool(s)


def test_lost_keys_leave_the_disk_index_and_a_tier_turned_off_is_forgotten(tmp_path):
    s, w = make(40, 4, {"host_pages": 40, "disk_dir": str(tmp_path), "disk_pages": 200}, enable_hierarchical_cache=True)
    tiers = s.mem.tiers
    for key in "abc":  # three sequences of one page each
        tiers.disk.put(key, tiers.disk.take_free(), None, 0, 4)
        tiers.links.entered(key, None)
    tiers.disk.put("d", tiers.disk.take_free(), "c", 4, 4)  # d follows c
    tiers.links.entered("d", "c")
    tiers.disk_tier.failed(DiskFaults(["a", "c", "zz"], [], errors=2))  # zz: dropped from the index meanwhile
    moves = tiers.take_moves()  # c's loss takes d along: nothing could reach it
    assert tiers.disk.keys() == ["b"] and moves == [KVMove(MoveKind.DROP, keys=["a", "c", "d"])]
    tiers.disk_tier.failed(DiskFaults(["b"], [], errors=6, disabled=True))
    assert tiers.links.after([None]) == []  # b, a first page, is linked no more: nothing holds it
    st = s.stats()
    assert st.disk_tier_enabled == 0 and st.disk_tier_errors == 8 and st.disk_pages == 0
    r = req("r", [i % 45 for i in range(60)], 3)
    assert run(s, w, [r])[0] == {"r": reference_generate(r.input_ids, 3)}
    assert_idle_pool(s)


# -- a real server whose disk tier is damaged while it runs ---------------------------------------

PAGE = 16
GREEDY = {"max_new_tokens": 4, "temperature": 0}


def test_a_server_outlives_damaged_page_files_and_a_deleted_disk_directory(llama_path, tmp_path):
    """Pages pushed down to disk, then: one page file of a document cut short (its read fails:
    recomputed, same tokens, the tier stays on); the directory deleted (writes fail until the
    tier turns itself off). Meanwhile an unrelated request is served; nothing leaks."""
    disk = tmp_path / "hicache"
    args = ("--page-size", str(PAGE), "--max-total-tokens", "128", "--enable-hierarchical-cache", "--hicache-ratio",
            "1", "--hicache-dir", str(disk), "--hicache-disk-size", "0.01", "--hicache-disk-max-errors", "3",
            "--hicache-load-policy", "always")  # every held page is read back: the damaged one is, whatever it costs
    # a document: 6 pages; device and host tiers: 8 pages each, so the first document spills to disk
    docs = [[(31 * d + 7 * i) % 1000 + 10 for i in range(6 * PAGE)] for d in range(4)]
    unrelated = list(range(100, 120))

    with running_server(llama_path, *args) as (url, _):
        def ask(ids):
            r = requests.post(url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}, timeout=60)
            assert r.status_code == 200, r.text
            return r.json()["output_ids"]

        want = [ask(doc) for doc in docs] + [ask(unrelated)]  # the fault-free answers
        assert server_info(url)["disk_tier_errors"] == 0
        (fingerprint_dir,) = [d for d in disk.iterdir() if d.is_dir()]
        victim = fingerprint_dir / disk_page_name(page_keys(docs[0], PAGE, DEFAULT_NAMESPACE.encoded)[3])
        assert victim.exists(), sorted(p.name for p in fingerprint_dir.iterdir())
        victim.write_bytes(victim.read_bytes()[:100])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = pool.submit(ask, docs[0])
            assert ask(unrelated) == want[-1]
            assert got.result() == want[0]
        info = server_info(url)
        assert info["disk_tier_errors"] >= 1 and info["disk_tier_enabled"] == 1 and info["disk_hit_pages"] >= 3, info
        assert info["recomputed_tokens"] > 0, info  # what read the lost page ran again

        shutil.rmtree(disk)
        got = [ask(doc) for doc in docs[1:]]
        assert got == want[1:-1] and ask(unrelated) == want[-1]
        info = server_info(url)
        metrics = Scrape.parse(requests.get(url + "/metrics", timeout=10).text)
        assert info["disk_tier_enabled"] == 0 and info["disk_tier_errors"] >= 4, info
        assert metrics.value("radixrt:disk_tier_enabled") == 0
        assert metrics.value("radixrt:disk_tier_errors_total") == info["disk_tier_errors"]
        assert_healthy_and_idle(url)

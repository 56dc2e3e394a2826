"""The KV tiers below the device pool, on the worker: a host-memory pool of pages and a
disk directory of page files, and the moves between them and the device pool.

The scheduler decides every move (radixrt/scheduler/kv_tiers.py) and sends them in
order as KVMoves before the step that needs them; this module only copies bytes,
in that order, so a slot written by one move and read by a later one is always
right. A page is copied whole: every tensor of the pool's `buffers` (K and V
values, and int8's scales), so quantized pages stay quantized in every tier.

Disk files are `<key>.r<rank>.kv` (radixrt.messages.disk_page_name: each
tensor-parallel rank holds its own KV heads) under a directory named by the
fingerprint of the weights, dtypes, page size and tp size: a different model
never reads them. The files themselves, and what their I/O errors come to (a lost
page, never a dead worker), are radixrt/worker/disk_tier.py's.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from pathlib import Path, PurePath, PurePosixPath
from typing import Callable

import torch

from radixrt.config_views import TierConfig
from radixrt.kernels import PagedKVCache
from radixrt.messages import DISK_PAGE_GLOB, DiskFaults, KVMove, MoveKind, MoveTime
from radixrt.settings.kv import rotates_keys
from radixrt.utils.gguf_sidecar import gguf_source
from radixrt.worker.disk_tier import DiskTier, PageFiles
from radixrt.worker.kv_pool import available_host_bytes
from radixrt.worker.store_pages import StorePages

logger = logging.getLogger(__name__)
DIGESTS_FILE = "weights-digests.json"  # in hicache_dir: file digests by path, size and mtime
STORE_PREFIX = "radixrt"  # a Mooncake Store's keys: radixrt/<fingerprint>/<page key>.r<rank>.kv


def digest_memo_dir(tiers: TierConfig) -> Path:
    """Where file digests are remembered: the disk tier's directory, else the user's cache."""
    if tiers.hicache_dir is not None:
        return Path(tiers.hicache_dir)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "radixrt"


def weight_files(root: Path) -> list[Path]:
    """The files the weights are read from: the checkpoint's safetensors, or the GGUF file a
    sidecar directory names (two quantizations of one model share config.json, not this)."""
    source = gguf_source(root)
    return [Path(source.path)] if source is not None else sorted(root.glob("*.safetensors"))


def weights_fingerprint(
    tiers: TierConfig, dtype: torch.dtype, fp8_scales: list[float] | None = None, model_path: str | None = None
) -> str:
    """What makes KV reusable across runs: the weights' whole content (config.json and a digest of
    each of weight_files; where the files live does not matter), the dtypes, the weights' quantization
    at load, the page size, the tensor-parallel split, an fp8 pool's per-layer scales (stored bytes mean nothing without them)
    and whether keys are stored rotated.
    model_path: the checkpoint (default tiers.model_path; a weight update names the new one). File
    digests are remembered by path, size and mtime (digest_memo_dir), so a restart does not rehash
    gigabytes."""
    root = Path(model_path or tiers.model_path)
    memo_path = digest_memo_dir(tiers) / DIGESTS_FILE
    try:
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        memo = json.loads(memo_path.read_text()) if memo_path.exists() else {}
    except OSError as e:  # a broken hicache_dir fails at start in prepare_disk_dir; after it, the disk tier turns off
        logger.warning("cannot keep weight digests in %s (%s): every start rehashes the weights", memo_path.parent, e)
        memo_path, memo = None, {}
    except ValueError:  # a digests file cut short or garbled: rewritten below
        memo = {}
    h = hashlib.sha256((root / "config.json").read_bytes())
    for f in weight_files(root):
        st = f.stat()
        stamp = f"{f.resolve()}:{st.st_size}:{st.st_mtime_ns}"
        if stamp not in memo:
            digest = hashlib.blake2b()
            with f.open("rb") as fh:
                while chunk := fh.read(1 << 24):
                    digest.update(chunk)
            memo[stamp] = digest.hexdigest()
        h.update(f"{f.name}:{memo[stamp]}".encode())
    if memo_path is not None:
        tmp = memo_path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(memo))
            os.replace(tmp, memo_path)
        except OSError as e:  # the digests are only a shortcut; prepare_disk_dir checks hicache_dir itself
            logger.warning("cannot keep weight digests in %s: %s", memo_path.parent, e)
    h.update(json.dumps([str(dtype), tiers.kv_cache_dtype, tiers.page_size, tiers.tp_size]).encode())
    if tiers.quantization not in (None, "gguf") or tiers.torchao_config:  # int8 weights make other KV
        h.update(json.dumps([tiers.quantization, tiers.torchao_config]).encode())
    if fp8_scales is not None:
        h.update(json.dumps(fp8_scales).encode())
    if rotates_keys(tiers.kv_cache_dtype, tiers.kv_cache_rotation):  # the same keys, other bytes
        h.update(b"rotated keys")
    return h.hexdigest()[:20]


def plan_host_pages(tiers: TierConfig, num_pages: int, page_bytes: int, device: torch.device) -> int:
    """Pages of the host pool: the hierarchical cache's host tier, or swap space for preemption."""
    if tiers.enable_hierarchical_cache:
        name = "hicache_size" if tiers.hicache_size else "hicache_ratio"
        size = tiers.hicache_size * 2**30 if tiers.hicache_size else num_pages * page_bytes * tiers.hicache_ratio
    elif tiers.preemption_mode != "recompute":
        name, size = "swap_space", tiers.swap_space * 2**30
    else:
        return 0
    ranks_here = tiers.ranks_per_node
    device_pool = num_pages * page_bytes if device.type == "cpu" else 0  # committed as it fills
    free = available_host_bytes() - device_pool * ranks_here
    if size * ranks_here > free:
        raise ValueError(
            f"{name}: the host KV tier needs {size * ranks_here / 2**30:.2f} GiB but only "
            f"{max(free, 0) / 2**30:.2f} GiB of host memory is available"
        )
    pages = int(size // page_bytes)
    if pages < 1:
        raise ValueError(f"{name}: the host KV tier ({size / 2**20:.2f} MiB) is smaller than one page")
    return pages


def prepare_disk_dir(tiers: TierConfig, fingerprint: str, page_bytes: int) -> tuple[PurePath, int]:
    """The disk tier's directory for the weights of this fingerprint (checked writable, created) and
    its capacity in pages. In a Mooncake Store: the keys' prefix, and the pages this server lends it."""
    if tiers.mooncake is not None:
        return PurePosixPath(STORE_PREFIX) / fingerprint, max(1, store_segment(tiers) // page_bytes)
    try:
        Path(tiers.hicache_dir).mkdir(parents=True, exist_ok=True)
        d = Path(tiers.hicache_dir) / fingerprint
        d.mkdir(exist_ok=True)
        probe = d / f".probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"hicache_dir {tiers.hicache_dir!r} is not writable: {e.strerror or e}") from None
    held = sum(f.stat().st_size for f in d.glob(DISK_PAGE_GLOB))
    size = tiers.hicache_disk_size * 2**30
    if size > shutil.disk_usage(d).free + held:
        raise ValueError(
            f"hicache_disk_size {tiers.hicache_disk_size} GB does not fit: {shutil.disk_usage(d).free / 2**30:.2f} GiB "
            f"free under {tiers.hicache_dir!r}"
        )
    return d, max(1, int(size // (page_bytes * tiers.tp_size)))


def store_segment(tiers: TierConfig) -> int:
    """The bytes each rank lends the Mooncake Store (SGLang's: global_segment_size over the ranks)."""
    assert tiers.mooncake is not None
    return tiers.mooncake.global_segment_size // tiers.tp_size


def tier_files(tiers: TierConfig) -> PageFiles | None:
    """What the disk tier's pages are kept by: the store's client, else files (None)."""
    return StorePages(tiers.mooncake, store_segment(tiers)) if tiers.mooncake is not None else None


class KVTierStore:
    """Host pages mirroring the device pool's buffers, a disk directory, and the copies."""

    def __init__(self, cache: PagedKVCache, host_pages: int, disk_dir: PurePath | None, disk_pages: int, rank: int,
                 max_disk_errors: int = 8, files: PageFiles | None = None,
                 prefetch_timeout: tuple[float, float] | None = None) -> None:
        self.cache = cache
        self.prefetch_timeout = prefetch_timeout  # (seconds, per 1024 tokens) a disk load may take; None: no bound
        self.host_pages = host_pages
        self.device = cache.k[0].device
        pin = self.device.type == "cuda"
        # host[i]: [host_pages, *cache.buffers[i].shape[1:]], same dtype (quantized pages stay quantized)
        self.host = [
            torch.empty((host_pages, *b.shape[1:]), dtype=b.dtype, pin_memory=pin) for b in cache.buffers
        ]
        self._page_bytes = [math.prod(b.shape[1:]) * b.element_size() for b in cache.buffers]
        self.disk: DiskTier | None = None
        if disk_dir is not None:
            self.disk = DiskTier(disk_dir, disk_pages, rank, sum(self._page_bytes), max_disk_errors, files)
        self._times: dict[MoveKind, tuple[int, float]] = {}  # kind -> (pages, seconds) since take_times()
        self._handlers: dict[MoveKind, Callable[[KVMove], None]] = {
            MoveKind.D2H: self._d2h,
            MoveKind.H2D: self._h2d,
            MoveKind.H2DISK: self._h2disk,
            MoveKind.D2DISK: self._d2disk,
            MoveKind.DISK2D: self._disk2d,
            MoveKind.DROP: self._drop,
        }
        assert self._handlers.keys() == set(MoveKind), "every MoveKind needs a handler"

    def describe(self) -> dict[str, int | str]:
        """The tiers' sizes, for the scheduler (WorkerReady fields); a disk tier that is off is none."""
        # a store that could not be reached at start is named all the same: it turns on when it answers
        on = self.disk is not None and (self.disk.enabled or getattr(self.disk.files, "remote", False))
        return {"host_pages": self.host_pages, "disk_dir": str(self.disk.dir) if on else "",
                "disk_pages": self.disk.capacity if on else 0}

    def take_faults(self) -> DiskFaults | None:
        return self.disk.take_faults() if self.disk is not None else None

    def close(self) -> None:
        if self.disk is not None:
            self.disk.files.close()

    def take_times(self) -> list[MoveTime]:
        """Pages moved and seconds spent, per kind, since the last call."""
        out = [MoveTime(kind, pages, seconds) for kind, (pages, seconds) in self._times.items()]
        self._times = {}
        return out

    def run(self, moves: list[KVMove]) -> None:
        """The moves, in order, each timed to its end on the device (the scheduler's cost estimates
        need each kind's own time; consecutive moves of a kind come merged, so syncs are few)."""
        for m in moves:
            seconds = self.time_moves([m])
            pages, total = self._times.get(m.kind, (0, 0.0))
            self._times[m.kind] = (pages + max(len(m.src), len(m.dst), len(m.keys)), total + seconds)

    def time_moves(self, moves: list[KVMove]) -> float:
        """Run moves (in order) and return the seconds they took to their end on the device,
        without counting them in take_times() (the start-up probe's moves are not service)."""
        start = time.perf_counter()
        for m in moves:
            self._handlers[m.kind](m)
        self.sync()
        return time.perf_counter() - start

    def sync(self) -> None:
        """Wait for the device's copies to end."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _ids(self, ids: list[int], device: torch.device) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.int64, device=device)

    def _d2h(self, m: KVMove) -> None:
        src, dst = self._ids(m.src, self.device), self._ids(m.dst, torch.device("cpu"))
        for h, d in zip(self.host, self.cache.buffers):
            h[dst] = d[src].cpu()

    def _h2d(self, m: KVMove) -> None:
        src, dst = self._ids(m.src, torch.device("cpu")), self._ids(m.dst, self.device)
        for h, d in zip(self.host, self.cache.buffers):
            d[dst] = h[src].to(self.device)

    def _h2disk(self, m: KVMove) -> None:
        self._write_files([h[self._ids(m.src, torch.device("cpu"))] for h in self.host], m.keys)

    def _d2disk(self, m: KVMove) -> None:
        src = self._ids(m.src, self.device)
        self._write_files([d[src].cpu() for d in self.cache.buffers], m.keys)

    def _disk2d(self, m: KVMove) -> None:
        """A page that cannot be read is skipped: its device page keeps whatever it held, and the
        disk tier's faults tell the scheduler to recompute what reads it."""
        disk, deadline = self._disk(), math.inf
        if self.prefetch_timeout is not None:  # pages not read in time are recomputed, as SGLang's timeout policy
            base, per_ki = self.prefetch_timeout
            deadline = time.perf_counter() + base + per_ki * len(m.dst) * self.cache.page_size / 1024
        read = [(page, disk.read(key, page) if time.perf_counter() < deadline else disk.skip(key, page))
                for key, page in zip(m.keys, m.dst)]
        self.files_to_device([data for _, data in read if data is not None],
                             [page for page, data in read if data is not None])

    def files_to_device(self, files: list[bytes], pages: list[int]) -> None:
        """Page files' bytes into device pages (files[i] into pages[i])."""
        if not files:
            return
        split = [self._split(data) for data in files]  # per page: one tensor per buffer
        dst = self._ids(pages, self.device)
        for i, d in enumerate(self.cache.buffers):
            d[dst] = torch.stack([p[i] for p in split]).to(self.device)

    def _drop(self, m: KVMove) -> None:
        for key in m.keys:
            self._disk().drop(key)

    def _disk(self) -> DiskTier:
        assert self.disk is not None, "a disk move without a disk tier"
        return self.disk

    def _write_files(self, tensors: list[torch.Tensor], keys: list[str]) -> None:
        """tensors[i]: [len(keys), ...] pages of buffer i; one file per key."""
        for key, chunks in zip(keys, page_chunks(tensors)):
            self._disk().write(key, chunks)

    def _split(self, data: bytes) -> list[torch.Tensor]:
        """One page file's bytes as one tensor per buffer."""
        flat, out, pos = torch.frombuffer(bytearray(data), dtype=torch.uint8), [], 0
        for n, b in zip(self._page_bytes, self.cache.buffers):
            out.append(flat[pos : pos + n].view(b.dtype).reshape(b.shape[1:]))
            pos += n
        return out


def page_chunks(tensors: list[torch.Tensor]) -> list[list[bytes]]:
    """tensors[i]: [pages, ...] pages of buffer i (on the CPU); per page, its page file's chunks."""
    raw = [t.contiguous().view(torch.uint8).reshape(t.shape[0], -1).numpy() for t in tensors]
    return [[r[j].tobytes() for r in raw] for j in range(tensors[0].shape[0])]

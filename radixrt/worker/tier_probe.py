"""The seeds of the scheduler's load-or-recompute choice (scheduler/tier_costs.py), measured at
start: what bringing one page back to the device costs from host memory and from disk, and what
share of a token's FLOPs its attention takes per position it attends (from the model's config).
"""

from __future__ import annotations

import contextlib
import logging
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from radixrt.messages import KVMove, MoveKind
from radixrt.models.config import ModelConfig
from radixrt.worker.disk_tier import DiskTier
from radixrt.worker.kv_tiers import KVTierStore, page_chunks

logger = logging.getLogger(__name__)
PROBE_PAGES = 4  # pages per timed copy
REPEATS = 3  # timed copies of each kind; their median counts


@dataclass(frozen=True)
class TransferProbe:
    """Seconds per page back to the device (0.0: no such tier, or the probe failed)."""

    h2d_s_per_page: float = 0.0
    disk2d_s_per_page: float = 0.0


def probe_transfers(store: KVTierStore, pages: int = PROBE_PAGES) -> TransferProbe:
    """Time host->device and disk->device copies of a few pages before any request runs: device
    pages 0..n go to host slots 0..n (which hold nothing yet) and to probe files, and come back
    unchanged. Nothing is counted as a tier move, and the probe files are removed."""
    n = min(pages, store.host_pages, store.cache.num_pages)
    if n == 0:
        return TransferProbe()
    ids = list(range(n))
    store.time_moves([KVMove(MoveKind.D2H, ids, ids), KVMove(MoveKind.H2D, ids, ids)])  # the first copies warm up
    h2d = statistics.median(store.time_moves([KVMove(MoveKind.H2D, ids, ids)]) for _ in range(REPEATS)) / n
    return TransferProbe(h2d, _probe_disk(store, ids))


def _probe_disk(store: KVTierStore, ids: list[int]) -> float:
    """Seconds per page to read page files and copy them to the device. The files are written
    through to the disk and dropped from the OS page cache before each read, so this is the
    disk's speed (in service a page read soon after its write may come from the page cache: the
    running estimate sees that). 0.0: no disk tier, or it failed (logged)."""
    disk = store.disk
    if disk is None or not disk.enabled:
        return 0.0
    # named as a temporary file: should a crash leave one, the next start's scan of the tier removes it
    paths = [disk.dir / f".probe-{os.getpid()}-{i}.tmp" for i in ids]
    local = not getattr(disk.files, "remote", False)  # a store's round trips are timed as they come
    try:
        for path, chunks in zip(paths, page_chunks([h[ids] for h in store.host])):
            _write_through(path, chunks) if local else disk.files.write(path, chunks)
        times = []
        for _ in range(REPEATS):
            for path in paths if local else []:
                _drop_cached(path)
            times.append(_timed_read(store, disk, paths, ids))
        return statistics.median(times) / len(ids)
    except OSError as e:
        logger.warning("cannot time the %s in %s (%s): its loads are not weighed against recomputing",
                       disk.files.label, disk.dir, e)
        return 0.0
    finally:
        for path in paths:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True) if local else disk.files.remove(path)


def _timed_read(store: KVTierStore, disk: DiskTier, paths: list[Path], ids: list[int]) -> float:
    """Seconds to read the page files at paths into device pages ids, to their end on the device."""
    start = time.perf_counter()
    store.files_to_device([disk.files.read(p) for p in paths], ids)
    store.sync()
    return time.perf_counter() - start


def _write_through(path: Path, chunks: list[bytes]) -> None:
    with path.open("wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def _drop_cached(path: Path) -> None:
    """Ask the OS to forget path's cached pages (Linux; elsewhere the read may be the cache's)."""
    if not hasattr(os, "posix_fadvise"):
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def attention_per_position(cfg: ModelConfig) -> float:
    """A token's attention FLOPs per position it attends, 4 * layers * heads * head_dim, over its
    other FLOPs, 2 per weight of the linear layers it runs through (the attention projections and
    the MLP, a sparse one's top-k experts; the embedding and the logits, computed for sampled rows
    only, are left out). Every layer counts as attending to every position: a sliding layer's
    window makes that an overestimate for deep positions."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    linear = 0
    for layer in range(cfg.num_layers):
        moe = cfg.moe is not None and layer in cfg.moe.layers
        mlp = 3 * h * (cfg.moe.intermediate_size * cfg.moe.top_k if moe else cfg.intermediate_size)
        linear += h * (2 * q + 2 * kv) + mlp
    return 4 * cfg.num_layers * q / (2 * linear)

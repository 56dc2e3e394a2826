"""What the scheduler measures for /metrics beyond its counters: each request's queueing time,
the most KV pages requests held at once, rank 0's memory watermark and the tiers' bytes."""

from __future__ import annotations

import time

from radixrt.messages import ReqOutput, WorkerMemory, WorkerReady


class SchedulerFigures:
    def __init__(self, worker: WorkerReady, tp_size: int) -> None:
        self.page_bytes = worker.page_bytes * tp_size  # one page on every rank
        self.memory = worker.memory or WorkerMemory()
        self.peak_used_pages = 0
        self._arrived: dict[str, float] = {}  # rid -> when it reached the scheduler, until first scheduled
        self._queue_times: dict[str, float] = {}  # rid -> its queueing time, until its next output carries it

    def arrived(self, rid: str) -> None:
        self._arrived[rid] = time.perf_counter()

    def scheduled(self, rid: str) -> None:
        """rid is in a batch: its first time ends its queueing (a retracted request's later ones do not)."""
        start = self._arrived.pop(rid, None)
        if start is not None:
            self._queue_times[rid] = time.perf_counter() - start

    def attach(self, outputs: list[ReqOutput]) -> None:
        """Each request's queueing time rides on its first output after it was scheduled; a finished
        request's bookkeeping ends here (one that never ran has none)."""
        for out in outputs:
            out.queue_time = self._queue_times.pop(out.rid, None)
            if out.finish is not None:
                self._arrived.pop(out.rid, None)

    def note_used(self, used_pages: int) -> None:
        """Pages requests hold, right after a step's allocation (the step's most)."""
        self.peak_used_pages = max(self.peak_used_pages, used_pages)

    def note_memory(self, memory: WorkerMemory | None) -> None:
        if memory is not None:
            self.memory = memory

    def stats(self, pool: dict[str, int]) -> dict[str, int]:
        """pool: KVMemory.stats() (the tiers' page counts)."""
        m, pb = self.memory, self.page_bytes
        return {
            "kv_peak_used_pages": self.peak_used_pages,
            "worker_rss_bytes": m.rss,
            "worker_rss_peak_bytes": m.rss_peak,
            "device_memory_allocated_bytes": m.device_allocated,
            "device_memory_reserved_bytes": m.device_reserved,
            "device_memory_peak_bytes": m.device_peak,
            "memory_limit_bytes": m.limit,
            "host_tier_used_bytes": (pool.get("host_cached_pages", 0) + pool.get("host_swap_pages", 0)) * pb,
            "host_tier_capacity_bytes": pool.get("host_pages", 0) * pb,
            "disk_tier_used_bytes": pool.get("disk_cached_pages", 0) * pb,
            "disk_tier_capacity_bytes": pool.get("disk_pages", 0) * pb,
        }

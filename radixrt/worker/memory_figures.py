"""The worker's memory watermark for /metrics: its process's resident set and high-water mark
(/proc/self/status), torch's CUDA allocator on a GPU, and the OOM line they are measured against.

Read at most once a second (MemoryFigures.due), so a step pays for it at most once a second.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from radixrt.messages import WorkerMemory

INTERVAL_S = 1.0
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def _status_kib(field: str) -> int:
    """A 'Field:   N kB' line of /proc/self/status, in bytes (0 where /proc is missing)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def host_memory_limit() -> int:
    """The host's memory (MemTotal), or its cgroup's limit when that is lower."""
    total = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    except OSError:
        pass
    for path in CGROUP_LIMITS:
        try:
            raw = Path(path).read_text().strip()
        except OSError:
            continue
        if raw.isdigit() and 0 < int(raw) < (total or 1 << 62):
            total = int(raw)
    return total


class MemoryFigures:
    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.device = device
        self.limit = torch.cuda.get_device_properties(device).total_memory if self.cuda else host_memory_limit()
        self._last = -INTERVAL_S

    def read(self) -> WorkerMemory:
        self._last = time.monotonic()
        figures = WorkerMemory(rss=_status_kib("VmRSS"), rss_peak=_status_kib("VmHWM"), limit=self.limit)
        if self.cuda:
            figures.device_allocated = torch.cuda.memory_allocated(self.device)
            figures.device_reserved = torch.cuda.memory_reserved(self.device)
            figures.device_peak = torch.cuda.max_memory_allocated(self.device)
        return figures

    def due(self) -> WorkerMemory | None:
        """Fresh figures when a second has passed since the last read, else None."""
        return self.read() if time.monotonic() - self._last >= INTERVAL_S else None

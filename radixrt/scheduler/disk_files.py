"""The tier below host memory as the scheduler sees it: which pages are there (rank 0's stand
for every rank's), in a directory (FileView) or a Mooncake Store (StoreView). The worker owns
the bytes (worker/disk_tier.py, worker/store_pages.py)."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path

from radixrt.kv_storage import Connector
from radixrt.messages import disk_page_key, disk_page_name
from radixrt.settings.hicache import MooncakeSettings

logger = logging.getLogger(__name__)
MEMO_SECONDS = 1.0  # how long the store's answer on a page stands (the policy asks every step)
MEMO_MAX = 1 << 17  # answers kept at most (then forgotten at once)
RETRY_SECONDS = 5.0


def page_files(d: Path) -> list[Path]:
    """Rank 0's page files in d (they stand for all ranks'), oldest first, after removing the
    temporary files of writes a crash cut short. A directory that cannot be read holds none."""
    found: list[tuple[float, Path]] = []
    try:
        for f in d.glob(disk_page_name("*")):
            with contextlib.suppress(FileNotFoundError):  # removed while listed
                found.append((f.stat().st_mtime, f))
        for tmp in d.glob("*.tmp*"):
            tmp.unlink(missing_ok=True)
    except OSError as e:
        logger.warning("cannot read the disk KV tier's directory %s: %s", d, e)
    return [f for _, f in sorted(found)]


def exists(path: Path) -> bool:
    """Whether path is there; one that cannot be looked at (permissions, I/O) is not."""
    try:
        return path.exists()
    except OSError:
        return False


class FileView:
    """The disk tier's directory: the pages a previous run left are adopted at start, and a page
    in the index is there while its file is."""

    shared = False  # only this server writes here: what it does not index, it never reads

    def __init__(self, d: Path) -> None:
        self.dir = d

    def adoptable(self) -> list[str]:
        return [disk_page_key(f.name) for f in page_files(self.dir)]

    def prepare(self, keys: list[str]) -> None:
        """Nothing to ask ahead: has() looks at one file."""

    def has(self, key: str) -> bool:
        return exists(self.dir / disk_page_name(key))

    def forget(self, keys: list[str]) -> None:
        """Nothing remembered: has() looks at the file each time."""


class StoreView:
    """A Mooncake Store shared by every server on its master (kv_storage.py): any of them may have
    put a page, and the store evicts on its own, so whether a page is there is asked, once per
    KVTiers.hits() for all its keys, and the answers are kept MEMO_SECONDS. This client lends the
    store no memory; while it has no connection the store holds nothing."""

    shared = True

    def __init__(self, settings: MooncakeSettings, prefix: str) -> None:
        self.prefix = prefix
        self.connector = Connector(settings, segment_bytes=0, buffer_bytes=1 << 20, retry_seconds=RETRY_SECONDS)
        self.connector.client()  # at start, while the master is (most likely) up
        self._memo: dict[str, tuple[bool, float]] = {}

    def adoptable(self) -> list[str]:
        return []  # nothing to adopt: pages are found when a request asks for them

    def prepare(self, keys: list[str]) -> None:
        now = time.monotonic()
        ask = [k for k in keys if self._memo.get(k, (False, -math.inf))[1] < now - MEMO_SECONDS]
        if not ask:
            return
        if len(self._memo) > MEMO_MAX:
            self._memo.clear()
        found = self._exist([f"{self.prefix}/{disk_page_name(k)}" for k in ask])
        self._memo.update((k, (f == 1, now)) for k, f in zip(ask, found))

    def has(self, key: str) -> bool:
        self.prepare([key])
        return self._memo[key][0]

    def forget(self, keys: list[str]) -> None:
        """keys are not there (they failed to read, and are being removed), whatever was asked before."""
        now = time.monotonic()
        self._memo.update((k, (False, now)) for k in keys)

    def _exist(self, names: list[str]) -> list[int]:
        """batch_is_exist's answers (1: there); all 0 until a connection stands."""
        client = self.connector.client()
        return client.batch_is_exist(names) if client is not None else [0] * len(names)

"""The disk tier's page files on one worker rank, and what their failures come to.

The disk tier is a cache, not a dependency. A page file that cannot be written or read
back whole (a full or read-only disk, its directory removed, a file cut short) loses
that page: the scheduler drops it from its index and recomputes its tokens. Each file
operation's outcome is noted in order; the ranks agree on them (ModelRunner.move: a
failure on any rank is a failure on all, since each holds its own KV heads of the
page), and settle() turns the agreed outcomes into DiskFaults for the scheduler. After
max_errors failures in a row the tier turns itself off: later operations fail at once
without touching the disk, and the scheduler stops sending them. A tier whose files can
come back (a store's master restarted: worker/store_pages.py) asks every RETRY_SECONDS and
turns on again, empty.

PageFiles is the one place that touches the files, so tests can wrap it to inject faults.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, TypeVar

from radixrt.messages import DiskFaults, disk_page_name

logger = logging.getLogger(__name__)
T = TypeVar("T")
RETRY_SECONDS = 5.0  # how often a tier that turned off asks whether its store is back


class PageFiles:
    """The file operations of the disk tier. Writes go to a temporary name and are renamed
    into place, so a crash never leaves a half page readable; a failed write leaves nothing."""

    label = "disk KV tier"  # what the log calls the tier these operations keep

    def write(self, path: Path, chunks: Iterable[bytes]) -> None:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        try:
            with tmp.open("wb") as f:
                for chunk in chunks:
                    f.write(chunk)
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise

    def read(self, path: Path) -> bytes:
        return path.read_bytes()

    def remove(self, path: Path) -> None:
        path.unlink(missing_ok=True)

    def close(self) -> None:
        """At shutdown (a store's client gives back the memory it lent)."""

    def healthy(self) -> bool:
        """Whether a tier that turned off may come back: a directory that failed stays off (a
        store reconnects: worker/store_pages.py)."""
        return False


class Outcome(enum.IntEnum):
    """One file operation's outcome; the ranks agree on the largest."""

    DONE = 0
    SKIPPED = 1  # the tier is off (every rank knows it: no rank touched the disk)
    FAILED = 2


@dataclass
class _Op:
    key: str
    page: int  # the device page a read fills; -1 for a write or a drop
    drop: bool
    error: str  # why it failed on this rank ("": it did not)
    outcome: Outcome


class DiskTier:
    def __init__(self, directory: Path, capacity: int, rank: int, page_bytes: int, max_errors: int,
                 files: PageFiles | None = None) -> None:
        self.dir, self.capacity, self.rank = directory, capacity, rank
        self.page_bytes = page_bytes  # one page's file: every buffer of the pool, this rank's heads
        self.max_errors = max_errors
        self.files = files or PageFiles()
        self.enabled = True
        self._ops: list[_Op] = []  # since the last settle()
        self._in_a_row = 0  # agreed failures since the last success
        self._faults = DiskFaults()  # since the last take_faults()
        self._retry_at = 0.0  # when a tier that is off next asks its files whether they are back

    def path(self, key: str) -> Path:
        return self.dir / disk_page_name(key, self.rank)

    def write(self, key: str, chunks: list[bytes]) -> None:
        self._attempt(key, -1, lambda: self.files.write(self.path(key), chunks))

    def read(self, key: str, page: int) -> bytes | None:
        """The page file's bytes for device page `page`; None if it cannot be read whole."""
        return self._attempt(key, page, lambda: self._read_whole(key))

    def skip(self, key: str, page: int) -> None:
        """A read not attempted (past its time: --hicache-storage-prefetch-policy timeout): its page is lost."""
        self._ops.append(_Op(key, page, False, "", Outcome.SKIPPED))

    def drop(self, key: str) -> None:
        self._attempt(key, -1, lambda: self.files.remove(self.path(key)), drop=True)

    def _read_whole(self, key: str) -> bytes:
        data = self.files.read(self.path(key))
        if len(data) != self.page_bytes:
            raise OSError(errno.EIO, f"the page file has {len(data)} bytes, expected {self.page_bytes}")
        return data

    def _attempt(self, key: str, page: int, fn: Callable[[], T], drop: bool = False) -> T | None:
        """Run one file operation; an OSError is noted (for settle) instead of raised."""
        op = _Op(key, page, drop, "", Outcome.SKIPPED)
        self._ops.append(op)
        if not self.enabled:
            return None
        try:
            out = fn()
        except OSError as e:
            op.error, op.outcome = f"{self.path(key).name}: {e.strerror or e}", Outcome.FAILED
            return None
        op.outcome = Outcome.DONE
        return out

    def outcomes(self) -> list[int]:
        """This rank's outcome of each operation since the last settle(), in order."""
        return [int(op.outcome) for op in self._ops]

    def settle(self, agreed: list[int]) -> None:
        """Take in every rank's outcomes (outcomes() reduced with max over the ranks): what failed
        anywhere is lost everywhere. Logs this rank's failures in one line."""
        ops, self._ops = self._ops, []
        mine = [op.error for op in ops if op.error]
        if mine:
            logger.warning("%s, rank %d: %d of %d page operations failed (first: %s); those pages are recomputed",
                           self.files.label, self.rank, len(mine), len(ops), mine[0])
        f = self._faults
        for op, outcome in zip(ops, agreed):
            if outcome == Outcome.DONE:
                self._in_a_row = 0
                continue
            if not op.drop:
                f.lost_keys.append(op.key)
            if op.page >= 0:
                f.lost_pages.append(op.page)
            if outcome == Outcome.FAILED:
                f.errors += 1
                self._in_a_row += 1
                if self.enabled and self._in_a_row >= self.max_errors:
                    self.turn_off(f"{self._in_a_row} page file operations failed in a row (last: "
                                  f"{op.error or 'on another rank'})")

    def turn_off(self, why: str) -> None:
        """Stop using the disk: every later operation fails at once, and the scheduler is told."""
        self.enabled = False
        self._faults.disabled = True
        if self.rank == 0:
            logger.error("the %s in %s is off: %s; its pages are recomputed from now on", self.files.label, self.dir, why)

    def rejoin(self) -> None:
        """A tier that is off asks its files, at most every RETRY_SECONDS, whether they are back; if so
        it is on again (empty: the scheduler starts a new index) and the scheduler is told."""
        now = time.monotonic()
        if self.enabled or now < self._retry_at:
            return
        self._retry_at = now + RETRY_SECONDS
        if self.files.healthy():
            self.enabled, self._in_a_row, self._faults.rejoined = True, 0, True
            if self.rank == 0:
                logger.warning("the %s in %s is back on", self.files.label, self.dir)

    def take_faults(self) -> DiskFaults | None:
        """What failed since the last call (None: nothing), for the scheduler."""
        self.rejoin()
        f = self._faults
        if not (f.lost_keys or f.lost_pages or f.errors or f.disabled or f.rejoined):
            return None
        self._faults = DiskFaults()
        return f

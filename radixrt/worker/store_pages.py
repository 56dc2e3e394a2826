"""The disk tier's page operations against a Mooncake Store (--hicache-storage-backend mooncake).

StorePages stands where PageFiles stands for a directory (worker/disk_tier.py): a page's
"path" (its fingerprint's prefix and disk_page_name) is its key in the store, so DiskTier's
bookkeeping (outcomes agreed over the ranks, lost pages recomputed, turning off after
failures in a row) serves both. Each value carries a header (magic, CRC-32, length): a value
cut short or corrupted reads as an I/O error, and its page is recomputed.

The store is a cache, not a dependency: a master that cannot be reached at start, or that
is lost later, makes operations fail (the tier turns off after max_errors of them); healthy()
reconnects, and DiskTier turns the tier on again when it answers (worker/disk_tier.py).
"""

from __future__ import annotations

import errno
import os
import socket
import struct
import zlib
from pathlib import PurePath
from typing import Any, Iterable

from radixrt.kv_storage import Connector
from radixrt.settings.hicache import MooncakeSettings
from radixrt.worker.disk_tier import PageFiles

HEADER = struct.Struct("<4sIQ")  # magic, CRC-32 of the page, its length
MAGIC = b"rxkv"
NO_SPACE = -200  # Mooncake's NO_AVAILABLE_HANDLE: the store cannot place the value now


def pack_value(chunks: Iterable[bytes]) -> bytes:
    data = b"".join(chunks)
    return HEADER.pack(MAGIC, zlib.crc32(data), len(data)) + data


def unpack_value(value: bytes) -> bytes:
    """The page's bytes; OSError(EIO) for a value that is not whole."""
    if len(value) < HEADER.size:
        raise OSError(errno.EIO, f"the stored value has {len(value)} bytes, less than its header")
    magic, crc, length = HEADER.unpack_from(value)
    data = value[HEADER.size :]
    if magic != MAGIC or length != len(data) or zlib.crc32(data) != crc:
        raise OSError(errno.EIO, f"the stored value is corrupt ({len(data)} bytes after its header, {length} written)")
    return data


class StorePages(PageFiles):
    remote = True  # the tier probe times store round trips, not a local disk
    label = "Mooncake store KV tier"

    def __init__(self, settings: MooncakeSettings, segment_bytes: int) -> None:
        self.settings = settings
        self.connector = Connector(settings, segment_bytes)
        self.connector.client()

    @property
    def store(self) -> Any:
        return self.connector.client()

    def healthy(self) -> bool:
        """Whether the store takes and gives back a value now (a connection is sought meanwhile)."""
        store = self.store
        if store is None:
            return False
        # a round trip: after a master restarts it answers queries before this client's memory is
        # mounted again, and until then every put fails
        key = f"radixrt-health-{socket.gethostname()}-{os.getpid()}"
        ok = store.put(key, b"ok") == 0 and store.get(key) == b"ok"
        store.remove(key, True)
        return ok

    def close(self) -> None:
        """Give back the memory this worker lent the store: the master stops placing pages there at
        once (a worker that dies leaves it to the master's client timeout, puts failing until then)."""
        self.connector.close()

    def _client(self) -> Any:
        store = self.store
        if store is None:
            raise OSError(errno.ENOTCONN, f"no connection to the Mooncake master at {self.settings.master}")
        return store

    def write(self, path: PurePath, chunks: Iterable[bytes]) -> None:
        rc = self._client().put(str(path), pack_value(chunks))
        if rc != 0:
            code = errno.ENOSPC if rc == NO_SPACE else errno.EIO
            raise OSError(code, f"the Mooncake store refused the page (error {rc})")

    def read(self, path: PurePath) -> bytes:
        value = self._client().get(str(path))
        if not value:
            raise OSError(errno.ENOENT, "the Mooncake store does not hold the page")
        return unpack_value(value)

    def remove(self, path: PurePath) -> None:
        # force: past the read lease Mooncake gives every get (10 s by default), which would keep a
        # page just read; a key the store no longer holds is gone either way
        self._client().remove(str(path), True)

"""The connection to a Mooncake Store (--hicache-storage-backend mooncake; its settings are
radixrt/settings/hicache.py's): the client import, the master's TCP probe, the connect call,
and the Connector that keeps calls away from a master that is down.

The store keeps the hierarchical cache's pages below host memory for every server configured
with its master: the worker puts and gets the bytes (worker/store_pages.py), the scheduler asks
which pages are there (scheduler/disk_files.py).
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

from radixrt.settings.hicache import MooncakeSettings

logger = logging.getLogger(__name__)

PROBE_SECONDS = 1.0  # a master that does not accept a TCP connection within this is down
GATE_SECONDS = 0.2  # how often a client looks whether its master is up (and how long it waits to know)
INVALID_PARAMS = -600  # Mooncake's error for settings it cannot take (a segment too small, say)
INSTALL = "pip install 'radixrt[mooncake]' (mooncake-transfer-engine-non-cuda; Debian's libibverbs1 beside it)"


class StoreDown(Exception):
    """The store cannot be reached now (a cache: its tier is off until it can)."""


def import_store() -> type:
    """MooncakeDistributedStore, or an ImportError that says what to install."""
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        missing = "libibverbs" in str(e)
        raise ImportError(f"--hicache-storage-backend mooncake needs the Mooncake Store client: "
                          f"{'apt-get install libibverbs1 (Debian)' if missing else INSTALL} ({e})") from None
    return MooncakeDistributedStore


def master_reachable(master: str, timeout: float = PROBE_SECONDS) -> bool:
    """Whether the master accepts a TCP connection (Mooncake's own setup waits 90 s for a dead one)."""
    host, _, port = master.rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def connect(settings: MooncakeSettings, segment_bytes: int, buffer_bytes: int = 16 << 20) -> Any:
    """A client of the store that lends it segment_bytes of this process's memory (0: none, for a
    client that only asks what is there). StoreDown when the master cannot be reached."""
    store_cls = import_store()
    if not master_reachable(settings.master):
        raise StoreDown(f"the Mooncake master at {settings.master} does not answer")
    store = store_cls()
    rc = store.setup(settings.local_hostname, settings.metadata_server, segment_bytes, buffer_bytes,
                     settings.protocol, settings.device, settings.master)
    if rc == INVALID_PARAMS:
        raise ValueError(f"the Mooncake store refused this client's settings (error {rc}): global_segment_size "
                         f"{segment_bytes} bytes per rank (Mooncake 0.3.13 took 16 MiB and more here), protocol "
                         f"{settings.protocol!r}, device {settings.device!r}")
    if rc != 0:
        raise StoreDown(f"Mooncake store setup with the master at {settings.master} failed (error {rc})")
    return store


class Connector:
    """A client of the store, (re)connected when asked: client() is None while no connection
    stands, and each call after a failure tries again, at most every retry_seconds. A master
    that stays down is logged once.

    NOTE: with its master gone a Mooncake client's calls fail, but one in a few blocks for about
    9 s (measured: 0.3.13, TCP; MC_RPC_TIMEOUT_MS and MC_RPC_CONNECT_TIMEOUT_MS do not shorten
    it), and its setup for minutes, holding the GIL (a thread would not spare the process). So
    no call goes out while the master refuses a TCP connection: only a call in flight as it
    dies can block, once."""

    def __init__(self, settings: MooncakeSettings, segment_bytes: int, buffer_bytes: int = 16 << 20,
                 retry_seconds: float = 5.0) -> None:
        self.settings, self.segment_bytes, self.buffer_bytes = settings, segment_bytes, buffer_bytes
        self.retry_seconds = retry_seconds
        self._client: Any = None
        self._next_try = 0.0
        self._gate_at, self._up = 0.0, False
        self._down_logged = False

    def client(self) -> Any:
        """The client, or None while the master is down (it refuses a TCP connection: looked at
        every GATE_SECONDS) or no connection stands."""
        now = time.monotonic()
        if now >= self._gate_at:
            self._gate_at, self._up = now + GATE_SECONDS, master_reachable(self.settings.master, GATE_SECONDS)
        if not self._up:
            return None
        if self._client is None and now >= self._next_try:
            self._next_try = now + self.retry_seconds
            self._connect()
        return self._client

    def _connect(self) -> None:
        try:
            self._client = connect(self.settings, self.segment_bytes, self.buffer_bytes)
        except StoreDown as e:
            if not self._down_logged:
                logger.warning("%s; its pages are recomputed until it answers", e)
            self._down_logged = True
            return
        self._down_logged = False
        logger.info("connected to the Mooncake store at %s (lending it %.0f MiB)", self.settings.master,
                    self.segment_bytes / 2**20)

    def close(self) -> None:
        """Give back the memory this client lent the store (the master stops placing pages there)."""
        if self._client is not None:
            self._client.close()
            self._client = None

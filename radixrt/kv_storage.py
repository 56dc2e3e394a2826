"""The hierarchical cache's storage backend (--hicache-storage-backend, SGLang 0.5.9's meaning):
which one, its settings, and the connection to a Mooncake Store.

`file` is our disk tier (worker/disk_tier.py) in a directory: hicache_dir, else SGLang's
SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else SGLang's /tmp/hicache. `mooncake` keeps the
same pages in a Mooncake Store (a master and the clients that lend it memory, over TCP or
RDMA) that every server configured with that master reads and writes: the worker puts and
gets the bytes (worker/store_pages.py), the scheduler asks which pages are there
(scheduler/disk_view.py). Its settings are read as SGLang's MooncakeStore reads them:
--hicache-storage-backend-extra-config naming master_server_address, else the JSON file that
SGLANG_HICACHE_MOONCAKE_CONFIG_PATH names, else the environment (MOONCAKE_MASTER,
MOONCAKE_PROTOCOL, MOONCAKE_DEVICE, MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_GLOBAL_SEGMENT_SIZE,
MOONCAKE_LOCAL_HOSTNAME), with SGLang's defaults.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from radixrt.config import ServerArgs

logger = logging.getLogger(__name__)

BACKENDS = ("file", "mooncake")
ELSEWHERE = ("hf3fs", "nixl", "aibrix", "dynamic", "eic")  # SGLang's others: refused by name
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
FILE_DIR_ENV, FILE_DIR_DEFAULT = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "/tmp/hicache"
CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
# SGLang's prefetch timeout (--hicache-storage-prefetch-policy timeout): base + per 1024 tokens, in seconds
PREFETCH_TIMEOUT_BASE, PREFETCH_TIMEOUT_PER_KI_TOKEN = 1.0, 0.25
PROBE_SECONDS = 1.0  # a master that does not accept a TCP connection within this is down
GATE_SECONDS = 0.2  # how often a client looks whether its master is up (and how long it waits to know)
INVALID_PARAMS = -600  # Mooncake's error for settings it cannot take (a segment too small, say)
INSTALL = "pip install 'radixrt[mooncake]' (mooncake-transfer-engine-non-cuda; Debian's libibverbs1 beside it)"


def parse_extra_config(text: str | None) -> dict[str, Any]:
    """--hicache-storage-backend-extra-config: a JSON object, or '@' and a JSON, YAML or TOML file."""
    if not text:
        return {}
    try:
        if text.startswith("@"):
            path = Path(text[1:])
            raw = path.read_text()
            if path.suffix in (".yaml", ".yml"):
                import yaml

                value = yaml.safe_load(raw)
            else:
                value = tomllib.loads(raw) if path.suffix == ".toml" else json.loads(raw)
        else:
            value = json.loads(text)
    except (OSError, ValueError) as e:
        raise ValueError(f"hicache_storage_backend_extra_config: cannot read {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"hicache_storage_backend_extra_config must be an object, got {type(value).__name__}")
    return value


def parse_size(value: Any) -> int:
    """A segment size as SGLang reads it: bytes, or a number of GB ("4gb")."""
    s = str(value).strip().lower()
    try:
        return int(s[:-2]) * 2**30 if s.endswith("gb") else int(s)
    except ValueError:
        raise ValueError(f"global_segment_size {value!r} is neither bytes nor a number of GB (\"4gb\")") from None


@dataclass(frozen=True)
class MooncakeSettings:
    master: str  # host:port of mooncake_master's RPC service
    metadata_server: str  # P2PHANDSHAKE, or an http://... metadata server
    protocol: str  # tcp or rdma
    device: str  # the RDMA device(s), "" over TCP
    local_hostname: str  # how the other clients reach this one
    global_segment_size: int  # bytes each server lends the store (split over its tensor-parallel ranks)

    @classmethod
    def resolve(cls, extra: Mapping[str, Any], env: Mapping[str, str] = os.environ) -> MooncakeSettings:
        """From the extra config when it names a master, else the file CONFIG_PATH_ENV names, else env."""
        if extra.get("master_server_address") or extra.get("client_server_address"):
            source, where = dict(extra), "hicache_storage_backend_extra_config"
        elif env.get(CONFIG_PATH_ENV):
            try:
                source, where = json.loads(Path(env[CONFIG_PATH_ENV]).read_text()), env[CONFIG_PATH_ENV]
            except (OSError, ValueError) as e:
                raise ValueError(f"{CONFIG_PATH_ENV}: cannot read {env[CONFIG_PATH_ENV]}: {e}") from None
        else:
            source = {"master_server_address": env.get("MOONCAKE_MASTER"), "client_server_address": env.get("MOONCAKE_CLIENT"),
                      "protocol": env.get("MOONCAKE_PROTOCOL"), "device_name": env.get("MOONCAKE_DEVICE"),
                      "metadata_server": env.get("MOONCAKE_TE_META_DATA_SERVER"),
                      "global_segment_size": env.get("MOONCAKE_GLOBAL_SEGMENT_SIZE"),
                      "local_hostname": env.get("MOONCAKE_LOCAL_HOSTNAME") or env.get("LOCAL_HOSTNAME")}
            source, where = {k: v for k, v in source.items() if v is not None}, "the environment"
        if source.get("client_server_address") and not source.get("master_server_address"):
            raise ValueError(f"{where}: a client_server_address alone (a standalone Mooncake store service) is not "
                             "supported; name the master: master_server_address (MOONCAKE_MASTER)")
        if not source.get("master_server_address"):
            raise ValueError("--hicache-storage-backend mooncake needs the store's master: MOONCAKE_MASTER=host:port, "
                             f"{CONFIG_PATH_ENV}, or master_server_address in --hicache-storage-backend-extra-config")
        if source.get("standalone_storage"):
            raise ValueError(f"{where}: standalone_storage (a store service holding the host pool) is not supported")
        return cls(master=str(source["master_server_address"]),
                   metadata_server=str(source.get("metadata_server", "P2PHANDSHAKE")),
                   protocol=str(source.get("protocol", "tcp")), device=str(source.get("device_name", "")),
                   local_hostname=str(source.get("local_hostname", "localhost")),
                   global_segment_size=parse_size(source.get("global_segment_size", "4gb")))


def check_storage_args(args: ServerArgs) -> None:
    """--hicache-storage-backend as SGLang means it (ValueError naming the flag); file without
    hicache_dir takes SGLang's directory."""
    backend = args.hicache_storage_backend
    if backend is None:
        return
    if backend in ELSEWHERE:
        raise ValueError(f"hicache_storage_backend {backend!r} is SGLang's, not supported here: {' or '.join(BACKENDS)}")
    if backend not in BACKENDS:
        raise ValueError(f"hicache_storage_backend must be one of {BACKENDS}, got {backend!r}")
    if not args.enable_hierarchical_cache:
        raise ValueError("hicache_storage_backend is the tier below the hierarchical cache's host memory: "
                         "add enable_hierarchical_cache")
    if args.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
        raise ValueError(f"hicache_storage_prefetch_policy must be one of {PREFETCH_POLICIES}, "
                         f"got {args.hicache_storage_prefetch_policy!r}")
    if backend == "file" and args.hicache_dir is None:
        object.__setattr__(args, "hicache_dir", os.environ.get(FILE_DIR_ENV) or FILE_DIR_DEFAULT)
    if backend == "mooncake" and args.hicache_dir is not None:
        raise ValueError("hicache_dir is the file backend's directory; with hicache_storage_backend mooncake "
                         "the pages below host memory live in the store")
    _ = args.mooncake, args.prefetch_timeout  # ValueError: the extra config or the store's settings


def mooncake_settings(backend: str | None, extra_config: str | None) -> MooncakeSettings | None:
    return MooncakeSettings.resolve(parse_extra_config(extra_config)) if backend == "mooncake" else None


def prefetch_timeout(policy: str, backend: str | None, extra_config: str | None) -> tuple[float, float] | None:
    """SGLang's timeout policy: (seconds, seconds per 1024 tokens) a load from storage may take; None: no bound."""
    if backend is None or policy != "timeout":
        return None
    extra = parse_extra_config(extra_config)
    return (float(extra.get("prefetch_timeout_base", PREFETCH_TIMEOUT_BASE)),
            float(extra.get("prefetch_timeout_per_ki_token", PREFETCH_TIMEOUT_PER_KI_TOKEN)))


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

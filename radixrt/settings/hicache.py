"""The hierarchical cache: the host tier below the device KV pool, and the tier below host memory
(--hicache-storage-backend, SGLang 0.5.9's meaning): the disk tier in a directory (`file`), or a
Mooncake Store every server on its master shares (`mooncake`, radixrt/kv_storage.py connects).

`file` is our disk tier (worker/disk_tier.py) in a directory: hicache_dir, else SGLang's
SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else SGLang's /tmp/hicache. The Mooncake Store's settings
are read as SGLang's MooncakeStore reads them: --hicache-storage-backend-extra-config naming
master_server_address, else the JSON file that SGLANG_HICACHE_MOONCAKE_CONFIG_PATH names, else the
environment (MOONCAKE_MASTER, MOONCAKE_PROTOCOL, MOONCAKE_DEVICE, MOONCAKE_TE_META_DATA_SERVER,
MOONCAKE_GLOBAL_SEGMENT_SIZE, MOONCAKE_LOCAL_HOSTNAME), with SGLang's defaults.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import tomllib

from radixrt.settings.fields import arg, check_at_least

BACKENDS = ("file", "mooncake")
ELSEWHERE = ("hf3fs", "nixl", "aibrix", "dynamic", "eic")  # SGLang's others: refused by name
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
FILE_DIR_ENV, FILE_DIR_DEFAULT = "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", "/tmp/hicache"
CONFIG_PATH_ENV = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
# SGLang's prefetch timeout (--hicache-storage-prefetch-policy timeout): base + per 1024 tokens, in seconds
PREFETCH_TIMEOUT_BASE, PREFETCH_TIMEOUT_PER_KI_TOKEN = 1.0, 0.25
WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
LOAD_POLICIES = ("measured", "always")


@dataclass(frozen=True)
class HiCacheArgs:
    enable_hierarchical_cache: bool = arg(
        False, "keep radix-cache pages evicted from the device pool in host memory (and on disk with hicache_dir)"
    )
    hicache_ratio: float = arg(2.0, "host tier size as a multiple of the device KV pool (when hicache_size is 0)")
    hicache_size: float = arg(0.0, "host tier size in GB (0: use hicache_ratio)")
    hicache_dir: str | None = arg(None, "directory of the disk tier (pages spilled from host memory; kept across restarts)")
    hicache_disk_size: float = arg(16.0, "disk tier size in GB")
    hicache_write_policy: str = arg(
        "write_through", "when a device page is copied to the host tier: write_through (as soon as it is cached), "
        "write_through_selective (when a request hits it the second time) or write_back (when it is evicted)"
    )
    hicache_load_policy: str = arg(
        "measured", "whether a request reads back pages the host and disk tiers hold: measured (only where loading "
        "them is measured to be faster than recomputing them) or always"
    )
    hicache_disk_max_errors: int = arg(
        8, "disk tier I/O errors in a row after which the disk tier turns itself off (its pages are then recomputed)"
    )
    hicache_storage_backend: str | None = arg(
        None, "the tier below host memory: file (the disk tier: hicache_dir, else $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, "
        "else /tmp/hicache) or mooncake (a Mooncake Store every server on its master shares; see docs/kv_storage.md)"
    )
    hicache_storage_prefetch_policy: str = arg(
        "best_effort", "how long a load from the storage backend may hold its step: best_effort or wait_complete (every "
        "page the measured cost picks), timeout (pages not read by prefetch_timeout_base + prefetch_timeout_per_ki_token "
        "per 1024 tokens, SGLang's 1 s + 0.25 s, are recomputed)"
    )
    hicache_storage_backend_extra_config: str | None = arg(
        None, "the storage backend's settings: a JSON object, or '@' and a JSON, YAML or TOML file (mooncake: "
        "master_server_address, protocol, global_segment_size, ...; timeout: prefetch_timeout_base, ...)"
    )

    def check(self) -> None:
        if self.hicache_write_policy not in WRITE_POLICIES:
            raise ValueError("hicache_write_policy must be write_through, write_through_selective or write_back, "
                             f"got {self.hicache_write_policy!r}")
        if self.hicache_load_policy not in LOAD_POLICIES:
            raise ValueError(f"hicache_load_policy must be measured or always, got {self.hicache_load_policy!r}")
        check_at_least(self, ("hicache_ratio", "hicache_size", "hicache_disk_size"), 0)
        if self.enable_hierarchical_cache and self.hicache_size == 0 and self.hicache_ratio == 0:
            raise ValueError("enable_hierarchical_cache needs a host tier: hicache_size > 0 or hicache_ratio > 0")
        if self.hicache_dir is not None and not self.enable_hierarchical_cache:
            raise ValueError("hicache_dir is the disk tier of the hierarchical cache: add enable_hierarchical_cache")
        if self.hicache_dir is not None and self.hicache_disk_size <= 0:
            raise ValueError(f"hicache_disk_size must be > 0 with hicache_dir, got {self.hicache_disk_size}")
        self._check_storage()
        check_at_least(self, ("hicache_disk_max_errors",), 1)

    def _check_storage(self) -> None:
        """--hicache-storage-backend as SGLang means it (ValueError naming the flag); file without
        hicache_dir takes SGLang's directory."""
        backend = self.hicache_storage_backend
        if backend is None:
            return
        if backend in ELSEWHERE:
            raise ValueError(f"hicache_storage_backend {backend!r} is SGLang's, not supported here: {' or '.join(BACKENDS)}")
        if backend not in BACKENDS:
            raise ValueError(f"hicache_storage_backend must be one of {BACKENDS}, got {backend!r}")
        if not self.enable_hierarchical_cache:
            raise ValueError("hicache_storage_backend is the tier below the hierarchical cache's host memory: "
                             "add enable_hierarchical_cache")
        if self.hicache_storage_prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"hicache_storage_prefetch_policy must be one of {PREFETCH_POLICIES}, "
                             f"got {self.hicache_storage_prefetch_policy!r}")
        if backend == "file" and self.hicache_dir is None:
            object.__setattr__(self, "hicache_dir", os.environ.get(FILE_DIR_ENV) or FILE_DIR_DEFAULT)
        if backend == "mooncake" and self.hicache_dir is not None:
            raise ValueError("hicache_dir is the file backend's directory; with hicache_storage_backend mooncake "
                             "the pages below host memory live in the store")
        _ = self.mooncake, self.prefetch_timeout  # ValueError: the extra config or the store's settings

    @property
    def storage_backend(self) -> str | None:
        """What holds the pages below host memory: file (hicache_dir, with or without the flag), mooncake, or None."""
        return self.hicache_storage_backend or ("file" if self.hicache_dir is not None else None)

    @property
    def mooncake(self) -> MooncakeSettings | None:
        """The Mooncake Store's settings (None: another backend, or none)."""
        return mooncake_settings(self.hicache_storage_backend, self.hicache_storage_backend_extra_config)

    @property
    def prefetch_timeout(self) -> tuple[float, float] | None:
        """--hicache-storage-prefetch-policy timeout: (seconds, seconds per 1024 tokens) a load may take."""
        return prefetch_timeout(self.hicache_storage_prefetch_policy, self.hicache_storage_backend,
                                self.hicache_storage_backend_extra_config)


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


def mooncake_settings(backend: str | None, extra_config: str | None) -> MooncakeSettings | None:
    return MooncakeSettings.resolve(parse_extra_config(extra_config)) if backend == "mooncake" else None


def prefetch_timeout(policy: str, backend: str | None, extra_config: str | None) -> tuple[float, float] | None:
    """SGLang's timeout policy: (seconds, seconds per 1024 tokens) a load from storage may take; None: no bound."""
    if backend is None or policy != "timeout":
        return None
    extra = parse_extra_config(extra_config)
    return (float(extra.get("prefetch_timeout_base", PREFETCH_TIMEOUT_BASE)),
            float(extra.get("prefetch_timeout_per_ki_token", PREFETCH_TIMEOUT_PER_KI_TOKEN)))

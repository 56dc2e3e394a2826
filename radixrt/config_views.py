"""Small frozen views of ServerArgs, one per kind of callee.

ServerArgs holds every flag (SGLang's names, validated once at construction). Code below
the process entry points takes only the part it reads: the device KV pool's sizing
(PoolConfig), the lower KV tiers (TierConfig), the HTTP front door (HttpConfig), the
scheduler (SchedulerConfig). A view's
fields are ServerArgs fields (or derived properties) of the same name, copied by `of`, so each setting keeps one
definition, one default and one validation, and a helper's signature says what it reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from radixrt.config import ServerArgs
    from radixrt.settings.hicache import MooncakeSettings
    from radixrt.settings.lora import LoraServing
    from radixrt.settings.retention import Retention
    from radixrt.settings.speculative import SpecSettings

V = TypeVar("V", bound="ConfigView")


class ConfigView:
    """Base of the views: `of(args)` copies the view's fields from ServerArgs by name."""

    @classmethod
    def of(cls: type[V], args: ServerArgs) -> V:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


@dataclass(frozen=True, kw_only=True)
class PoolConfig(ConfigView):
    """What sizes the device KV pool and its page table."""

    page_size: int
    max_total_tokens: int | None
    mem_fraction_static: float | None
    max_running_requests: int


@dataclass(frozen=True, kw_only=True)
class TierConfig(ConfigView):
    """The host and disk tiers (and swap space), and what makes their KV reusable across runs."""

    model_path: str
    page_size: int
    kv_cache_dtype: str
    kv_cache_rotation: str  # rotated keys are other bytes
    quantization: str | None  # weights quantized at load compute other KV (a pre-quantized
    torchao_config: str  # checkpoint says so in its config.json, which the fingerprint reads)
    tp_size: int
    nnodes: int
    enable_hierarchical_cache: bool
    hicache_ratio: float
    hicache_size: float
    hicache_dir: str | None
    hicache_disk_size: float
    hicache_disk_max_errors: int
    hicache_storage_backend: str | None
    mooncake: MooncakeSettings | None  # the Mooncake Store's settings (its backend only)
    prefetch_timeout: tuple[float, float] | None  # --hicache-storage-prefetch-policy timeout's bound
    preemption_mode: str
    swap_space: float

    @property
    def ranks_per_node(self) -> int:
        return self.tp_size // self.nnodes


@dataclass(frozen=True, kw_only=True)
class HttpConfig(ConfigView):
    """The HTTP front door: who may call, from where, and how large a call may be."""

    host: str
    api_key: str | None
    admin_api_key: str | None
    api_keys_file: str | None
    allowed_hosts: str | None
    max_request_bytes: int
    max_n: int
    max_requests_per_call: int


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig(ConfigView):
    """What the scheduler decides with: batch limits and order, the cache, preemption, bounded
    KV, grammars and spot checks (`retention` and `prefill_chunk` are ServerArgs' derived values)."""

    max_running_requests: int
    prefill_chunk: int
    max_prefill_tokens: int
    max_decode_slowdown: float
    schedule_policy: str
    enable_priority_scheduling: bool
    schedule_low_priority_values_first: bool
    priority_scheduling_preemption_threshold: int
    abort_on_priority_when_disabled: bool
    max_queued_requests: int | None
    req_waiting_timeout: float | None
    req_running_timeout: float | None
    api_keys_file: str | None
    tenant_kv_quota: float
    disable_radix_cache: bool
    radix_eviction_policy: str
    max_pinned_fraction: float
    max_pinned_namespace_fraction: float
    enable_hierarchical_cache: bool
    hicache_write_policy: str
    hicache_load_policy: str
    hicache_storage_backend: str | None
    mooncake: MooncakeSettings | None
    preemption_mode: str
    swap_min_tokens: int
    retention: Retention
    speculative: SpecSettings
    lora: LoraServing | None
    disable_jump_forward: bool
    json_max_whitespace: int | None
    reasoning_parser: str | None
    quality_spot_check_rate: float
    quality_spot_check_min_agreement: float
    quality_spot_check_queue: int
    random_seed: int
    tp_size: int

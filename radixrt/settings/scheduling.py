"""The scheduling settings a server starts with: the batch and prefill budgets, the admission
policy, priorities, queue limits and timeouts with SGLang's meaning, tenants (the API keys
file), and what preemption does with a retracted request's KV.

SGLang's names and meanings (0.5.9):
  * `--enable-priority-scheduling`: larger `priority` values run first (smaller ones with
    `--schedule-low-priority-values-first`); a request without one is the least important.
  * `--priority-scheduling-preemption-threshold` (10): a waiting request preempts a running
    one whose priority is lower by more than this.
  * `--abort-on-priority-when-disabled`: without priority scheduling, a request that sets
    `priority` is answered with a 503 (else the field is ignored).
  * `--max-queued-requests`: a new request beyond it gets a 503.
  * `SGLANG_REQ_WAITING_TIMEOUT` / `SGLANG_REQ_RUNNING_TIMEOUT` (seconds, <= 0 off): a request
    waiting (running) longer ends with a 503. radixrt also takes them as flags, which win.
radixrt's own: `--api-keys-file` (JSON, key -> TenantSpec) and `--tenant-kv-quota`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgspec

from radixrt.settings.fields import arg

PREEMPTION_MODES = ("recompute", "swap", "auto")
POLICY_NAMES = ("lpm", "fcfs")  # radixrt/scheduler/policy.py
# SGLang's abort messages, word for word (all with status 503)
PRIORITY_DISABLED = "Using priority is disabled for this server. Please send a new request without a priority."
QUEUE_FULL = "The request queue is full."
OUTRANKED = "The request is aborted by a higher priority request."
WAITING_TIMEOUT = "Request waiting timeout reached."
RUNNING_TIMEOUT = "Request running timeout reached."
TIMEOUT_ENV = {"req_waiting_timeout": "SGLANG_REQ_WAITING_TIMEOUT", "req_running_timeout": "SGLANG_REQ_RUNNING_TIMEOUT"}
TENANT_MAX_CHARS = 128


class TenantSpec(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """One API key's tenant, as the keys file gives it."""

    tenant: str
    weight: float = 1.0  # its share of the running slots and prefill tokens under contention
    kv_quota: float | None = None  # a fraction of the device pool (None: --tenant-kv-quota)
    share_cache: bool = False  # its requests read and fill the cache other sharing tenants use


def load_api_keys(path: str) -> dict[str, TenantSpec]:
    """The keys file's key -> TenantSpec. Raises ValueError naming the file and what is wrong."""
    try:
        with open(path, "rb") as f:
            keys = msgspec.json.decode(f.read(), type=dict[str, TenantSpec])
    except OSError as e:
        raise ValueError(f"api_keys_file {path!r} cannot be read: {e.strerror}") from None
    except msgspec.ValidationError as e:
        raise ValueError(f"api_keys_file {path!r}: {e} (each key maps to {{\"tenant\": NAME, \"weight\": W, "
                         f"\"kv_quota\": FRACTION, \"share_cache\": BOOL}})") from None
    except msgspec.DecodeError as e:
        raise ValueError(f"api_keys_file {path!r} is not valid JSON: {e}") from None
    if not keys:
        raise ValueError(f"api_keys_file {path!r} names no keys")
    for key, spec in keys.items():
        _check_tenant(path, key, spec)
    return keys


def _check_tenant(path: str, key: str, spec: TenantSpec) -> None:
    where = f"api_keys_file {path!r}, key {key[:4]}...:"
    if not key.strip() or key != key.strip():
        raise ValueError(f"api_keys_file {path!r}: a key is empty or has surrounding spaces")
    if not spec.tenant or len(spec.tenant) > TENANT_MAX_CHARS:
        raise ValueError(f"{where} tenant must be 1 to {TENANT_MAX_CHARS} characters")
    if not spec.weight > 0:
        raise ValueError(f"{where} weight must be > 0, got {spec.weight}")
    if spec.kv_quota is not None and not 0 < spec.kv_quota <= 1:
        raise ValueError(f"{where} kv_quota must be in (0, 1], got {spec.kv_quota}")


def tenant_table(path: str | None) -> dict[str, TenantSpec]:
    """Every tenant named by the keys file (the first spec of each name), by name."""
    table: dict[str, TenantSpec] = {}
    for spec in (load_api_keys(path) if path else {}).values():
        table.setdefault(spec.tenant, spec)
    return table


def env_timeout(flag: str) -> float | None:
    """The SGLang environment variable behind a timeout flag: its seconds, or None when unset or <= 0."""
    raw = os.environ.get(TIMEOUT_ENV[flag], "").strip()
    if not raw:
        return None
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV[flag]} must be a number of seconds, got {raw!r}") from None
    return seconds if seconds > 0 else None


@dataclass(frozen=True)
class SchedulingArgs:
    chunked_prefill_size: int = arg(
        4096, "the most prompt tokens one request prefills in a step (a longer prompt runs in chunks of this many); "
        "-1 disables chunking"
    )
    max_prefill_tokens: int = arg(
        16384, "the most prompt tokens prefilled in one step, all requests together (SGLang's per-batch budget)"
    )
    max_decode_slowdown: float = arg(
        1.5, "while streamed requests decode, a step's prefill tokens are cut so that the step is predicted (from "
        "measured step times) to take at most this many times a decode-only step: long prompts cannot stall the "
        "tokens a client is reading, at the cost of their own TTFT (a request answered in one piece has no pace to "
        "keep: it never cuts a step); 0: off (a step prefills up to max_prefill_tokens)"
    )
    max_running_requests: int = arg(256, "maximum requests in the running batch")
    schedule_policy: str = arg(
        "lpm", "admission order within a priority level and a tenant's share: lpm (longest cached prefix first) or fcfs"
    )
    enable_priority_scheduling: bool = arg(
        False, "admit waiting requests by their priority field first (larger is more important; a request without "
        "one is the least important), then by schedule_policy; see priority_scheduling_preemption_threshold"
    )
    schedule_low_priority_values_first: bool = arg(False, "with priority scheduling, smaller priority values go first")
    priority_scheduling_preemption_threshold: int = arg(
        10, "with priority scheduling, a waiting request whose priority exceeds a running one's by more than this "
        "preempts it (by preemption_mode) when no slot or pages are free"
    )
    abort_on_priority_when_disabled: bool = arg(
        False, "without priority scheduling, answer a request that sets priority with a 503 (else it is ignored)"
    )
    max_queued_requests: int | None = arg(
        None, "the most requests waiting to run; a new one beyond it gets a 503 (with priority scheduling, the "
        "least important waiting request gets it instead when the new one outranks it)"
    )
    req_waiting_timeout: float | None = arg(
        None, "seconds a request may wait before it first runs; then it ends with a 503 (default: "
        "SGLANG_REQ_WAITING_TIMEOUT, else none)"
    )
    req_running_timeout: float | None = arg(
        None, "seconds a request may run from its first step; then it ends with a 503 (default: "
        "SGLANG_REQ_RUNNING_TIMEOUT, else none)"
    )
    api_keys_file: str | None = arg(
        None, 'JSON {"<key>": {"tenant": NAME, "weight": 1.0, "kv_quota": FRACTION, "share_cache": false}}: each '
        "key is accepted as api_key is and names its tenant (fair share by weight, KV quota, a cache of its own "
        "unless share_cache); without it a request's tenant is its cache_salt"
    )
    tenant_kv_quota: float = arg(
        1.0, "the cached KV pages one tenant may hold before its pages are evicted first, as a fraction of the "
        "device pool (a keys file's kv_quota overrides it per tenant); pins past it are refused; 1: no quota"
    )
    preemption_mode: str = arg(
        "recompute", "a retracted request's KV: recompute it, swap it to host memory, or auto (swap long ones)"
    )
    swap_space: float = arg(4.0, "host memory in GB for swapped requests when the hierarchical cache is off")
    # bench/kv_memory.py on CPU: swapping beats recomputing from about 21 tokens (tiny model) and at every
    # measured length (124M model); 64 is the smallest measured length where it won on both.
    swap_min_tokens: int = arg(64, "auto preemption swaps requests holding at least this many tokens")

    def check(self) -> None:
        """Raise ValueError naming the flag whose value cannot run; a timeout flag left unset takes
        SGLang's environment variable (the flag wins)."""
        if self.chunked_prefill_size != -1 and self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be -1 or >= 1, got {self.chunked_prefill_size}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.schedule_policy not in POLICY_NAMES:
            raise ValueError(f"schedule_policy must be lpm or fcfs, got {self.schedule_policy!r}")
        if self.priority_scheduling_preemption_threshold < 0:
            raise ValueError("priority_scheduling_preemption_threshold must be >= 0, "
                             f"got {self.priority_scheduling_preemption_threshold}")
        if self.max_queued_requests is not None and self.max_queued_requests < 1:
            raise ValueError(f"max_queued_requests must be >= 1, got {self.max_queued_requests}")
        for flag in TIMEOUT_ENV:
            if getattr(self, flag) is None:
                object.__setattr__(self, flag, env_timeout(flag))
            seconds = getattr(self, flag)
            if seconds is not None and not seconds > 0:
                raise ValueError(f"{flag} must be > 0 seconds, got {seconds}")
        if not 0 < self.tenant_kv_quota <= 1:
            raise ValueError(f"tenant_kv_quota must be in (0, 1], got {self.tenant_kv_quota}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.max_decode_slowdown != 0 and not self.max_decode_slowdown > 1:
            raise ValueError(f"max_decode_slowdown must be 0 (off) or > 1, got {self.max_decode_slowdown}")
        if self.api_keys_file is not None:
            load_api_keys(self.api_keys_file)  # ValueError naming the file and the key
        self._check_preemption()

    def _check_preemption(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0, got {self.swap_space}")
        if self.swap_min_tokens < 0:
            raise ValueError(f"swap_min_tokens must be >= 0, got {self.swap_min_tokens}")

    @property
    def prefill_chunk(self) -> int:
        """Prompt tokens one step may prefill (chunking off: effectively unbounded)."""
        return self.chunked_prefill_size if self.chunked_prefill_size != -1 else 1 << 62

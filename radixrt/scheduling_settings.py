"""The production-scheduling settings a server starts with: priorities, queue limits and
timeouts with SGLang's meaning, and tenants (the API keys file).

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

import msgspec

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


def check_scheduling_args(threshold: int, max_queued: int | None, timeouts: dict[str, float | None],
                          tenant_kv_quota: float, max_prefill_tokens: int, max_decode_slowdown: float) -> None:
    """Raise ValueError naming the flag whose value cannot run."""
    if threshold < 0:
        raise ValueError(f"priority_scheduling_preemption_threshold must be >= 0, got {threshold}")
    if max_queued is not None and max_queued < 1:
        raise ValueError(f"max_queued_requests must be >= 1, got {max_queued}")
    for flag, seconds in timeouts.items():
        if seconds is not None and not seconds > 0:
            raise ValueError(f"{flag} must be > 0 seconds, got {seconds}")
    if not 0 < tenant_kv_quota <= 1:
        raise ValueError(f"tenant_kv_quota must be in (0, 1], got {tenant_kv_quota}")
    if max_prefill_tokens < 1:
        raise ValueError(f"max_prefill_tokens must be >= 1, got {max_prefill_tokens}")
    if max_decode_slowdown != 0 and not max_decode_slowdown > 1:
        raise ValueError(f"max_decode_slowdown must be 0 (off) or > 1, got {max_decode_slowdown}")

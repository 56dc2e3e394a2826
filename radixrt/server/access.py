"""Who may do what at the HTTP door: SGLang's key levels, who is the admin, and whose requests
GET /cache_report covers.

The key levels are SGLang's: /health*, /metrics and CORS preflights are open; the admin routes
take admin_api_key when set, else api_key; every other route takes api_key when set. A route that
takes no key gets the browser checks instead (browser_guard.py).
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from radixrt.config_views import HttpConfig
from radixrt.errors import RequestError
from radixrt.frontend.generate_input import SALT_MAX_CHARS, cache_namespace
from radixrt.namespace import CacheNamespace
from radixrt.settings.scheduling import TenantSpec, load_api_keys

OPEN_PREFIXES = ("/health", "/metrics")  # probes and scrapers need no key (as in SGLang)
ADMIN_PATHS = ("/abort_request", "/flush_cache", "/update_weights_from_disk",  # SGLang's ADMIN_OPTIONAL routes
               "/load_lora_adapter", "/unload_lora_adapter")


def bearer_token(header: str | None) -> str | None:
    """The key of 'Authorization: Bearer <key>' (the scheme in any case), or None."""
    scheme, _, token = (header or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer_matches(header: str | None, key: str) -> bool:
    """'Authorization: Bearer <key>', the scheme in any case, compared in constant time."""
    token = bearer_token(header)
    return token is not None and hmac.compare_digest(token.encode(), key.encode())


class TenantKeys:
    """--api-keys-file's keys, each naming its tenant. Keys are held by their SHA-256 digest, so
    a lookup's time does not depend on how much of a wrong key matches a right one."""

    def __init__(self, path: str | None) -> None:
        self._by_digest = {_digest(k): spec for k, spec in (load_api_keys(path) if path else {}).items()}

    def __bool__(self) -> bool:
        return bool(self._by_digest)

    def tenant_of(self, header: str | None) -> TenantSpec | None:
        token = bearer_token(header)
        return None if token is None else self._by_digest.get(_digest(token))


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


@dataclass(frozen=True)
class Access:
    """What the door decided for one request: whether its route takes a key, whether the caller
    may pass, and the tenant its key names (None: not a tenant key)."""

    needs_key: bool
    allowed: bool
    tenant: TenantSpec | None = None


def authorize(path: str, method: str, authorization: str | None, http: HttpConfig, keys: TenantKeys) -> Access:
    """SGLang's key levels (required_key), where a tenant's key from --api-keys-file also opens
    every route api_key opens (not the admin routes when an admin or api key is set)."""
    key = required_key(path, http, method)
    open_route = path.startswith(OPEN_PREFIXES) or method == "OPTIONS"
    if open_route or (key is None and not keys):
        return Access(False, True)
    tenant = keys.tenant_of(authorization) if keys else None
    if key is not None and bearer_matches(authorization, key):
        return Access(True, True, tenant)
    admin_only = path in ADMIN_PATHS and (http.admin_api_key or http.api_key)
    return Access(True, tenant is not None and not admin_only, tenant)


def required_key(path: str, http: HttpConfig, method: str = "GET") -> str | None:
    """SGLang's auth levels: every /health* route, /metrics and CORS preflights (OPTIONS) are open;
    admin routes take admin_api_key when set, else api_key; every other route takes api_key (when set)."""
    if path.startswith(OPEN_PREFIXES) or method == "OPTIONS":
        return None
    if path in ADMIN_PATHS:
        return http.admin_api_key or http.api_key
    return http.api_key


def is_admin(authorization: str | None, http: HttpConfig) -> bool:
    """Whether the caller presents the admin credential: admin_api_key, or api_key when there is no
    admin key. A server without keys has no admin: nobody can prove to be one."""
    key = http.admin_api_key or http.api_key
    return key is not None and bearer_matches(authorization, key)


def cache_report_scope(http: HttpConfig, authorization: str | None, cache_salt: str | None,
                       extra_key: str | None) -> CacheNamespace | None:
    """Whose recent requests GET /cache_report covers: every namespace (None) for an admin who names
    none; else the namespace named by the query's cache_salt and extra_key, combined as /generate
    combines them (neither: the unsalted one). Knowing a salt is what lets a client use its cache,
    so it is also what lets it read that cache's diagnosis."""
    for value, name in ((cache_salt, "cache_salt"), (extra_key, "extra_key")):
        if value is not None and len(value) > SALT_MAX_CHARS:
            raise RequestError(f"{name} is longer than {SALT_MAX_CHARS} characters", name)
    if cache_salt is None and extra_key is None and is_admin(authorization, http):
        return None
    return cache_namespace(cache_salt, extra_key)

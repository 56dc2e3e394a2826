"""Who may do what at the HTTP door: SGLang's key levels, who is the admin, and whose requests
GET /cache_report covers.

The key levels are SGLang's: /health*, /metrics and CORS preflights are open; the admin routes
take admin_api_key when set, else api_key; every other route takes api_key when set. A route that
takes no key gets the browser checks instead (browser_guard.py).
"""

from __future__ import annotations

import hmac

from radixrt.config_views import HttpConfig
from radixrt.errors import RequestError
from radixrt.frontend.generate_input import SALT_MAX_CHARS, cache_namespace
from radixrt.namespace import CacheNamespace

OPEN_PREFIXES = ("/health", "/metrics")  # probes and scrapers need no key (as in SGLang)
ADMIN_PATHS = ("/abort_request", "/flush_cache", "/update_weights_from_disk")  # SGLang's ADMIN_OPTIONAL routes


def bearer_matches(header: str | None, key: str) -> bool:
    """'Authorization: Bearer <key>', the scheme in any case, compared in constant time."""
    scheme, _, token = (header or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key.encode())


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

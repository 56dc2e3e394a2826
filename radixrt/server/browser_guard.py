"""What a web page could send through a visitor's browser, refused on the routes that take no key.

A server without --api-key trusts whoever reaches its port, and a browser on the same machine
reaches it for any web page it visits. Two attacks follow, and keys stop both (a page cannot
attach the bearer), so BrowserGuard guards exactly the routes that take no key:

  cross-site request forgery: a page sends a "simple request" (no CORS preflight) to
      127.0.0.1:30000: a form or text/plain POST, a bodiless fetch POST, an <img> GET;
  DNS rebinding: a page points its own domain name at 127.0.0.1 and then talks to the server
      as its own origin, reading answers too.

The checks, on every route but the open ones (/health*, /metrics: no key even with keys set):
  Host      must be a loopback name or address, the bind address, or in --allowed-hosts (an entry
            without a port allows any port; bound to 0.0.0.0 or ::, any IP literal too): a
            rebinding page's requests carry its own domain name (400);
  Origin    when sent, must be this server's own (host and port of Host): a browser sends it with
            every cross-origin POST, and no other client does (403);
  Sec-Fetch-Site  cross-site or same-site is refused on a request that changes state (403);
  Content-Type    a body must be application/json (415): the one type a page cannot send cross-site
            without a CORS preflight, and this server answers no preflight. A bodiless request
            without one passes (SGLang's clients and sglang-router POST /flush_cache so): a browser
            sends that cross-site only with an Origin, refused above;
  GET on an admin route (SGLang allows GET /flush_cache) is refused (405): an <img> sends it,
            with no Origin and, to a plain-http address, no Sec-Fetch-Site.
"""

from __future__ import annotations

import ipaddress
from typing import Mapping
from urllib.parse import urlsplit

from radixrt.config_views import HttpConfig
from radixrt.server.access import ADMIN_PATHS, OPEN_PREFIXES
from radixrt.server.http_common import ApiError

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
WILDCARD_BINDS = ("0.0.0.0", "::", "")
SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
NO_KEY = "a server without --api-key"


def split_host(value: str) -> tuple[str, int | None]:
    """A Host header (or --allowed-hosts entry) as (lower-case name or address, port or None):
    "name", "name:80", "[::1]:80", "::1" (bare IPv6, no port)."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
    elif value.count(":") == 1:
        name, _, port = value.partition(":")
    else:
        name, port = value, ""
    return name.rstrip("."), int(port) if port.isdigit() else None


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


class HostAllowlist:
    """The Host values served: loopback names and addresses, the bind address, --allowed-hosts
    entries ("*": any), and any IP literal when the server is bound to a wildcard address."""

    def __init__(self, http: HttpConfig) -> None:
        extra = [e.strip() for e in (http.allowed_hosts or "").split(",") if e.strip()]
        self.anything = "*" in extra
        self.any_ip = http.host.strip("[]") in WILDCARD_BINDS
        self.entries = [split_host(e) for e in (*LOOPBACK_HOSTS, http.host, *extra) if e != "*"]

    def allows(self, host: str) -> bool:
        name, port = split_host(host)
        if self.anything or (self.any_ip and _is_ip(name)):
            return True
        return any(name == n and (p is None or p == port) for n, p in self.entries)


class BrowserGuard:
    def __init__(self, http: HttpConfig) -> None:
        self.hosts = HostAllowlist(http)

    def refusal(self, method: str, path: str, headers: Mapping[str, str]) -> ApiError | None:
        """Why a request to a route that takes no key is refused (the module's checks), or None."""
        if path.startswith(OPEN_PREFIXES) or method == "OPTIONS":
            return None
        host = headers.get("host")
        if host is not None and not self.hosts.allows(host):
            return ApiError(400, f"Host {host!r} is not served: {NO_KEY} answers only the loopback names, its bind "
                            "address and the hosts in --allowed-hosts (against DNS rebinding)", "Host", cause="host")
        if method in SAFE_METHODS and path not in ADMIN_PATHS:
            return None  # reads: a cross-site page cannot see the answer, a rebinding one was refused above
        return _cross_site(headers, host) or _method_or_body(method, path, headers)


def _cross_site(headers: Mapping[str, str], host: str | None) -> ApiError | None:
    origin, site = headers.get("origin"), headers.get("sec-fetch-site")
    if origin is not None and not _same_origin(origin, host):
        return ApiError(403, f"cross-site request refused: Origin {origin!r} is not this server; {NO_KEY} "
                        "serves no other web origin", "Origin", cause="cross_site")
    if site in ("cross-site", "same-site"):
        return ApiError(403, f"cross-site request refused (Sec-Fetch-Site: {site}); {NO_KEY} serves no other "
                        "web origin", "Sec-Fetch-Site", cause="cross_site")
    return None


def _method_or_body(method: str, path: str, headers: Mapping[str, str]) -> ApiError | None:
    """A GET to an admin route, or a body that is not JSON."""
    if method in SAFE_METHODS:
        return ApiError(405, f"{path} changes the server: use POST ({NO_KEY} refuses GET here: any web page "
                        "can send one, from an <img>)", "method", cause="method")
    kind = headers.get("content-type")
    if kind is None and not _has_body(headers):
        return None
    if kind is None or kind.split(";")[0].strip().lower() != "application/json":
        return ApiError(415, f"Content-Type must be application/json, got {kind!r} ({NO_KEY} refuses other "
                        "types: a web page can send them cross-site)", "Content-Type", cause="content_type")
    return None


def _has_body(headers: Mapping[str, str]) -> bool:
    return headers.get("content-length", "0").strip() not in ("", "0") or "transfer-encoding" in headers


def _same_origin(origin: str, host: str | None) -> bool:
    """Whether Origin names the host and port the request was sent to (Host; none sent: nothing to
    compare, so not the same). A port left out of Host is not compared."""
    if host is None:
        return False
    try:
        parts = urlsplit(origin)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:  # "null", or a malformed port
        return False
    name, host_port = split_host(host)
    return parts.hostname is not None and parts.hostname.rstrip(".") == name and host_port in (None, port)

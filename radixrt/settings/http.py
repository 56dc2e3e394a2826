"""The HTTP front door: where it binds, who may call it, and the limits on what one call may ask."""

from __future__ import annotations

from dataclasses import dataclass

from radixrt.settings.fields import arg, check_at_least


@dataclass(frozen=True)
class HttpArgs:
    host: str = arg("127.0.0.1", "HTTP host to bind (launch_server)")
    port: int = arg(30000, "HTTP port to bind (launch_server)")
    api_key: str | None = arg(None, "require 'Authorization: Bearer <key>' on every endpoint but /health* and /metrics")
    admin_api_key: str | None = arg(
        None, "key for the admin endpoints (/abort_request, /flush_cache); without it they take api_key"
    )
    allowed_hosts: str | None = arg(
        None, "comma-separated Host names (name or name:port) served, beyond the loopback names and addresses and "
        "the bind address (bound to 0.0.0.0 or ::, any IP address too); '*' serves any. Checked, with Origin and "
        "Content-Type, on routes that take no API key, against DNS rebinding and cross-site requests from web pages"
    )
    max_request_bytes: int = arg(32 << 20, "largest request body in bytes; a larger one gets 413 before it is parsed")
    max_n: int = arg(128, "largest n (parallel samples) one request may ask for")
    max_requests_per_call: int = arg(
        1024, "most requests one HTTP call may make (its prompts times n); a larger call gets 400 before any of it runs"
    )
    allow_auto_truncate: bool = arg(
        False, "truncate a prompt (and max_new_tokens) that exceeds the context instead of refusing it with a 400"
    )
    request_read_timeout: float = arg(
        30.0, "seconds a client has to send a request's headers and body; an idle or half-sent connection is closed"
    )
    max_connections: int = arg(
        2048, "open HTTP connections at most; beyond it new requests get 503, but for GET /health, always answered"
    )
    graceful_shutdown_timeout: float = arg(
        30.0, "on SIGTERM, seconds in-flight requests may take to finish before they get a 503"
    )
    enable_metrics: bool = arg(False, "accepted for SGLang compatibility: /metrics is always on")

    def check(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65536), got {self.port}")
        check_at_least(self, ("max_request_bytes", "max_n", "max_requests_per_call", "max_connections"), 1)
        if self.allowed_hosts is not None and any(not h.strip() or "/" in h for h in self.allowed_hosts.split(",")):
            raise ValueError(f"allowed_hosts must be comma-separated host names (name or name:port), "
                             f"got {self.allowed_hosts!r}")
        if self.request_read_timeout <= 0:
            raise ValueError(f"request_read_timeout must be > 0, got {self.request_read_timeout}")
        if self.graceful_shutdown_timeout < 0:
            raise ValueError(f"graceful_shutdown_timeout must be >= 0, got {self.graceful_shutdown_timeout}")

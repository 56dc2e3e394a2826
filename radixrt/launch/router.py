"""SGLang's router in front of a data-parallel deployment: whether it is installed, its command
line, and whether it is up. `sglang_router` (`radixrt[router]`) with `--policy cache_aware` keeps
an approximate radix tree of the text it sent to each replica and sends a request to the replica
that holds the longest prefix of it (the least loaded one when the loads drift apart), so a prefix
keeps meeting the radix cache that computed it. How far apart the loads may drift is ours to set
(threshold_flags).

The HTTP here is the launcher's probing of processes it started (/health, /workers), not serving.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request

from radixrt.config import ServerArgs

ROUTER_INSTALL = 'pip install "radixrt[router]" (or pip install sglang-router)'
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two")
ROUTER_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}


def check_router() -> None:
    """Raise ValueError, saying how to install it, unless SGLang's router can be imported."""
    try:
        import sglang_router.router  # noqa: F401  (the Rust core; launch_router wraps it)
    except ImportError as e:
        raise ValueError(f"dp_size > 1 runs SGLang's router, which cannot be imported ({e}): {ROUTER_INSTALL}") from None


def router_command(args: ServerArgs, worker_urls: list[str], policy: str, metrics_port: int) -> list[str]:
    """SGLang's router on the public host:port, in front of worker_urls."""
    cmd = [
        sys.executable, "-m", "sglang_router.launch_router", "--host", args.host, "--port", str(args.port),
        "--worker-urls", *worker_urls, "--policy", policy, "--log-level", ROUTER_LOG_LEVELS.get(args.log_level, "info"),
        "--prometheus-host", args.host, "--prometheus-port", str(metrics_port),
        "--max-payload-size", str(args.max_request_bytes),
        "--shutdown-grace-period-secs", str(max(1, round(args.graceful_shutdown_timeout))),
        *threshold_flags(args),
    ]
    return cmd + (["--api-key", args.api_key] if args.api_key else [])


def threshold_flags(args: ServerArgs) -> list[str]:
    """The cache_aware policy's thresholds (the router ignores them under other policies).

    How the router (0.3.x) routes a request: when the busiest replica has more than
    balance_abs_threshold requests in flight over the idlest *and* more than balance_rel_threshold
    times as many, to the idlest; otherwise to the replica holding the longest prefix of its text
    when that prefix is more than cache_threshold of the text, else (a miss) to the idlest (on a
    tie the same one each time). NOTE: its default abs floor of 64 means that below 64 requests in flight
    a prefix always goes home, so replicas that were sent the documents first take all their
    questions while the others idle; we lower the floor (ServerArgs.router_balance_abs_threshold).
    """
    return [
        "--cache-threshold", str(args.router_cache_threshold),
        "--balance-abs-threshold", str(args.router_balance_abs_threshold),
        "--balance-rel-threshold", str(args.router_balance_rel_threshold),
    ]


def router_ready(url: str, api_key: str | None, replicas: int) -> bool:
    """Every replica registered with the router at url and healthy (its /readiness would say 503,
    logged as an error, until then; /workers says it quietly). The router asks for the key too."""
    status, body = _get(url + "/workers", api_key)
    return status == 200 and sum(w.get("is_healthy", False) for w in json.loads(body)["workers"]) == replicas


def healthy(url: str) -> bool:
    """The server at url answers /health with 200."""
    return _get(url + "/health")[0] == 200


def local_url(host: str, port: int) -> str:
    """http://host:port to connect to; a wildcard bind address is reached on loopback."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _get(url: str, api_key: str | None = None, timeout: float = 2.0) -> tuple[int, bytes]:
    """Status and body of a GET (with the api key, when there is one); (0, b"") when nothing answers."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (OSError, ValueError):
        return 0, b""

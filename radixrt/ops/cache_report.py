"""`radixrt cache-report URL`: why a running server's prompts miss the prefix cache.

GETs URL/cache_report (radixrt/frontend/cache_report.py builds it) and prints it for a person: the
diagnosed causes first, then the hit rate, where prompts diverge from the cache, and the hit rate of
prompts that share a system prompt. The server answers for the cache namespace named by --cache-salt
and --extra-key (neither: requests without them), or for every namespace to --api-key holding the
admin key when neither is given. --json prints the report as the server sent it. Exit status 0;
1, with one line on stderr, when the server cannot be reached or does not answer 200.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import requests

from radixrt.frontend.cache_report import CACHE_REPORT_FIRST_N
from radixrt.launch_server import OneLineParser

TIMEOUT_S = 10.0


def fetch(url: str, first_n: int, api_key: str | None, timeout: float = TIMEOUT_S, cache_salt: str | None = None,
          extra_key: str | None = None) -> dict[str, Any]:
    """The server's report. Raises requests.RequestException (unreachable, or a non-200 answer)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    params = {"first_n": first_n, "cache_salt": cache_salt, "extra_key": extra_key}  # None: left out
    resp = requests.get(f"{url.rstrip('/')}/cache_report", params=params, headers=headers, timeout=timeout)
    if resp.status_code != 200:
        raise requests.HTTPError(f"{resp.url} answered {resp.status_code}: {resp.text[:200]}")
    return resp.json()


def render(report: dict[str, Any]) -> str:
    """The report as text, its causes' messages first."""
    causes = report["causes"]
    lines = ["causes:"] + [f"  - [{c['kind']}] {c['message']}" for c in causes] if causes else ["causes: none found"]
    div, shared = report["divergence"], report["shared_prefix"]
    pct = " ".join(f"{k} {v}" for k, v in div["percentiles"].items())
    scope = {"all": ", every cache namespace", "namespace": ", this cache namespace"}.get(report.get("scope"), "")
    lines += [
        f"recent prompts: {report['prompts']} ({report['prompt_tokens']} tokens{scope}), hit rate {report['hit_rate']:.1%}, "
        f"tokens shared with recent prompts {report['shared_token_rate']:.1%}"
        + ("" if report["cache_enabled"] else " (the prefix cache is disabled)"),
        f"divergence position (cached tokens per prompt): {pct}; {report['early_divergence_share']:.0%} within the "
        f"first {report['first_n']} tokens, {div['fully_matched_share']:.0%} fully matched",
        *(f"  {bucket:>10} tokens: {count}" for bucket, count in div["buckets"].items()),
        f"prompts sharing a system prompt: {shared['prompts']}, hit rate {shared['hit_rate']:.1%}",
    ]
    mem = report.get("memory")
    if mem is not None:
        lines += [
            f"KV tiers: {mem['host_cached_pages']} pages in host memory, {mem['disk_cached_pages']} on disk; loaded "
            f"back {mem['host_hit_pages']} from host, {mem['disk_hit_pages']} from disk; chosen to load "
            f"{mem['tier_load_pages']}, to recompute {mem['tier_recompute_pages']}",
            f"unreachable pages: {mem['unreachable_pages']} (held below an earlier page held nowhere; "
            f"{mem['cascade_dropped_pages']} dropped with an earlier page)",
            f"pinned pages: {mem['pinned_pages']} of a budget of {mem['pin_budget_pages']} in "
            f"{mem['pinned_namespaces']} namespaces; pins granted {mem['pins_taken']}, refused {mem['pins_refused']}, "
            f"pages expired {mem['pinned_pages_expired']}, dropped early {mem['pinned_dropped_pages']}",
        ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = OneLineParser(prog="radixrt cache-report", description="Why a running server's prompts miss the prefix cache.")
    parser.add_argument("url", help="the server, e.g. http://127.0.0.1:30000")
    parser.add_argument("--first-n", type=int, default=CACHE_REPORT_FIRST_N,
                        help="a prompt diverging within its first N tokens diverges early")
    parser.add_argument("--api-key", default=None, help="the server's api key (sent as 'Authorization: Bearer KEY')")
    parser.add_argument("--cache-salt", default=None, help="report on the requests sent with this cache_salt")
    parser.add_argument("--extra-key", default=None, help="report on the requests sent with this extra_key")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    ns = parser.parse_args(argv)
    try:
        report = fetch(ns.url, ns.first_n, ns.api_key, cache_salt=ns.cache_salt, extra_key=ns.extra_key)
    except (requests.RequestException, ValueError) as e:  # ValueError: a body that is not JSON
        why = f"cannot reach {ns.url}: {e}" if isinstance(e, requests.ConnectionError) else str(e)
        print(f"radixrt cache-report: {' '.join(why.split())}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if ns.json else render(report))
    return 0

"""HTTP helpers for the tests that talk to a server: a POST and /metrics read as numbers."""

from __future__ import annotations

import json
from typing import Any

import requests
from radixrt.ops.prom import Scrape


def post(url: str, path: str, body: Any, **kw: Any) -> requests.Response:
    """POST body to url + path: as JSON, or as it is when it is already text or bytes (malformed
    bodies), with JSON's content type (a keyless server wants it). kw go to requests, headers merged."""
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    headers = {"Content-Type": "application/json", **kw.pop("headers", {})}
    kw.setdefault("timeout", 120)
    return requests.post(url + path, data=data, headers=headers, **kw)


def metrics(url: str) -> dict[str, float]:
    """/metrics as {sample name with its labels: value}, and each SGLang-named sample also by its
    bare name (summed over its labels: one model, one scheduler)."""
    scrape = Scrape.parse(requests.get(url + "/metrics", timeout=10).text)
    out: dict[str, float] = {}
    for (name, labels), value in scrape.samples.items():
        out[name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels) + "}" if labels else "")] = value
        if name.startswith("sglang:"):
            out[name] = out.get(name, 0.0) + value
    return out

"""Small HTTP helpers over requests: JSON calls and SSE streams, errors as RuntimeEndpointError."""

from __future__ import annotations

import json
from typing import Any, Iterator

import requests

from ..errors import RuntimeEndpointError


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _check(resp: requests.Response, url: str) -> None:
    if resp.ok:
        return
    try:
        body = resp.json()
        message = body["error"]["message"] if isinstance(body.get("error"), dict) else str(body)
    except (ValueError, AttributeError, KeyError, TypeError):
        message = resp.text.strip() or resp.reason
    raise RuntimeEndpointError(message, resp.status_code, url)


def call(method: str, url: str, body: Any = None, api_key: str | None = None, timeout: float | None = None) -> Any:
    """One request; the decoded JSON answer (or its text when it is not JSON)."""
    try:
        resp = requests.request(method, url, json=body, headers=_headers(api_key), timeout=timeout)
    except requests.RequestException as e:
        raise RuntimeEndpointError(f"cannot reach the server: {e}", None, url) from e
    _check(resp, url)
    try:
        return resp.json()
    except ValueError:
        return resp.text


def stream(url: str, body: Any, api_key: str | None = None, timeout: float | None = None) -> Iterator[dict[str, Any]]:
    """POST and yield each `data: {...}` event of the SSE answer until `data: [DONE]`."""
    try:
        resp = requests.post(url, json=body, headers=_headers(api_key), timeout=timeout, stream=True)
    except requests.RequestException as e:
        raise RuntimeEndpointError(f"cannot reach the server: {e}", None, url) from e
    with resp:
        _check(resp, url)
        # NOTE: decode the bytes ourselves: for text/event-stream without a charset requests
        # would guess ISO-8859-1, and the server sends UTF-8.
        for raw in resp.iter_lines():
            line = raw.decode("utf-8")
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                return
            event = json.loads(data)
            if isinstance(event, dict) and isinstance(event.get("error"), dict):
                raise RuntimeEndpointError(event["error"].get("message", str(event)), resp.status_code, url)
            yield event

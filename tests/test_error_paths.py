"""Error paths that were 500s, cut-off streams or hangs (issue 29, #8 and #9): chat inputs nested
too deeply for the chat template are a 400 naming the field and the limit; tool-call text that
is not strict JSON (NaN, a lone surrogate, nesting too deep) stays content; a stream that fails
after its 200 still ends with an error event and [DONE] and is counted; a model_path too long
or a weights directory holding a FIFO is a 400 naming it, and the server keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests
from support.server_proc import assert_healthy_and_idle, running_server

from radixrt.model_source import Hub, MODEL_FILES, local_dir
from radixrt.server.http_common import SSE_DONE, Submission, guarded_events, sse
from radixrt.server.metrics import ServerMetrics
from radixrt.server.nesting import MAX_TEMPLATE_DEPTH, nesting_depth
from radixrt.server.tool_calls import TOOL_CALL_PARSERS, StreamingToolParser, calls_from_constrained
from radixrt.utils.checkpoint_meta import read_header
from support.scheduling import make

ARGS = ("--tool-call-parser", "hermes", "--disable-jump-forward", "--page-size", "16", "--max-total-tokens", "4096")
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
HI = [{"role": "user", "content": "hi"}]


def nested(n: int) -> dict:
    """{"a": {"a": ... {}}}: n levels of objects."""
    value: dict = {}
    for _ in range(n - 1):
        value = {"a": value}
    return value


def call_text(arguments: str, name: str = "f") -> str:
    return f'<tool_call>{{"name": "{name}", "arguments": {arguments}}}</tool_call>'


NOT_STRICT = {  # tool-call text a parser once passed on (NaN, Infinity) or died on (a 500, a cut stream)
    "nan": call_text('{"a": NaN}'), "infinity": call_text('{"a": [Infinity, -Infinity]}'),
    "overflow": call_text('{"a": 1e999}'),
    "surrogate": call_text('{"a": "\\ud800"}'), "surrogate_name": call_text("{}", name="\\udfff"),
    "deep": call_text('{"a": ' + "[" * 990 + "]" * 990 + "}"),
}


# --- pure functions -------------------------------------------------------------------------------

@pytest.mark.parametrize("case", NOT_STRICT)
def test_tool_call_text_that_is_not_strict_json_stays_content(case):
    text = NOT_STRICT[case]
    assert TOOL_CALL_PARSERS["hermes"].parse(text) == (text, [])
    stream = StreamingToolParser("hermes")
    pieces = [stream.feed(text[i:i + 7]) for i in range(0, len(text), 7)] + [stream.finish()]
    assert "".join(p.content for p in pieces) == text and not any(p.calls for p in pieces)
    constrained = text.removeprefix("<tool_call>").removesuffix("</tool_call>").replace('"arguments"', '"parameters"')
    with pytest.raises(ValueError):
        calls_from_constrained(f"[{constrained}]")
    assert TOOL_CALL_PARSERS["hermes"].parse(call_text('{"a": 1.5}')).calls[0].arguments == '{"a": 1.5}'


def test_nesting_depth_is_measured_without_recursion():
    assert [nesting_depth(v) for v in (1, "x", [], {}, [[1]], {"a": [{}]}, nested(7))] == [0, 0, 1, 1, 2, 3, 7]
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    assert nesting_depth(deep) == 100_001


def test_a_stream_that_fails_after_its_200_ends_with_an_error_event_and_done():
    aborted: list[str] = []
    manager = SimpleNamespace(abort=lambda rid: aborted.append(rid) or True)
    metrics = ServerMetrics(make(num_pages=8, page_size=4)[0].stats)
    sub = Submission(SimpleNamespace(manager=manager, metrics=metrics))
    sub.states = [SimpleNamespace(rid="r1", done=False, log_metrics=True)]

    async def broken():
        yield sse({"text": "a"})
        raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")

    async def read() -> list[bytes]:
        return [event async for event in guarded_events(sub, broken())]

    events = asyncio.run(read())
    assert events[0] == sse({"text": "a"}) and events[-1] == SSE_DONE and len(events) == 3
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert error["code"] == 500 and "UnicodeEncodeError" in error["message"]
    assert aborted == ["r1"]
    labels = {"status": "500", "cause": "internal"}
    assert metrics.registry.get_sample_value("radixrt:internal_errors_total", labels) == 1
    sub.abort()  # once: the stream's own cleanup aborts nothing again, and counts no client abort
    assert aborted == ["r1"] and not metrics.registry.get_sample_value("sglang:num_aborted_requests_total",
                                                                       {"model_name": ""})


def make_fifo_checkpoint(src: Path, dst: Path, fifo: str) -> Path:
    """src's files linked into dst, with `fifo` a FIFO instead (no writer: a read would block)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.name != fifo:
            (dst / f.name).symlink_to(f)
    os.mkfifo(dst / fifo)
    return dst


def test_checkpoint_files_must_be_regular_and_headers_fit_their_file(llama_path, tmp_path):
    fifo_dir = make_fifo_checkpoint(llama_path, tmp_path / "fifo", "model.safetensors")
    with pytest.raises(ValueError, match="model.safetensors, not regular files"):  # what a start runs first
        local_dir(str(fifo_dir), None, "model_path", lambda p: None, MODEL_FILES, Hub(tmp_path, True))
    with pytest.raises(ValueError, match="not a regular file"):
        read_header(fifo_dir / "model.safetensors")
    liar = tmp_path / "liar.safetensors"
    liar.write_bytes((10_000).to_bytes(8, "little") + b"{}")
    with pytest.raises(ValueError, match="header length 10000, file size 10"):
        read_header(liar)
    liar.write_bytes((6).to_bytes(8, "little") + b'{"a":1}')
    with pytest.raises(ValueError, match="unreadable safetensors header"):
        read_header(liar)
    with pytest.raises(ValueError, match="limit is 4096"):
        local_dir("x" * 100_000, None, "model_path", lambda p: None, MODEL_FILES, Hub(tmp_path, True))


# --- through a server ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def server(llama_path):
    with running_server(llama_path, *ARGS) as (url, _):
        yield url


def internal_errors(url: str) -> float:
    text = requests.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("radixrt:internal_errors_total"))


@contextlib.contextmanager
def unharmed(url: str, rids: tuple[str, ...] = ()):
    """An unrelated request is served while the body runs; after it, no 5xx was answered, the
    server is healthy and idle (no page leaked), and the rids the body used are free again."""
    before, served = internal_errors(url), {}

    def unrelated() -> None:
        served["r"] = requests.post(url + "/generate", json={"text": "hello", "sampling_params": {"max_new_tokens": 4}},
                                    timeout=60)

    thread = threading.Thread(target=unrelated)
    thread.start()
    yield
    thread.join(60)
    assert served["r"].status_code == 200 and served["r"].json()["meta_info"]["completion_tokens"] == 4
    assert internal_errors(url) == before
    for rid in rids:
        r = requests.post(url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 1, "rid": rid}, timeout=60)
        assert r.status_code == 200, r.text
    assert_healthy_and_idle(url)


def chat(url: str, **body) -> requests.Response:
    return requests.post(url + "/v1/chat/completions", json={"messages": HI, **body}, timeout=60,
                         stream=body.get("stream", False))


DEEP = nested(600)
TOO_DEEP = {  # field -> body: nested 600 levels, where the chat template once recursed past Python's limit
    "tools": {"tools": [{"type": "function", "function": {"name": "f", "parameters": DEEP}}]},
    "tool_choice": {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f", "x": DEEP}}},
    "chat_template_kwargs": {"chat_template_kwargs": {"x": DEEP}},
    "messages[1].tool_calls": {"messages": HI + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": DEEP}}]},
        {"role": "user", "content": "x"}]},
}


def test_chat_inputs_nested_too_deeply_are_a_400_naming_field_and_limit(server):
    with unharmed(server, rids=tuple(f"deep-{i}" for i in range(len(TOO_DEEP)))):
        for i, (field, body) in enumerate(TOO_DEEP.items()):
            r = chat(server, max_tokens=1, rid=f"deep-{i}", **body)
            assert r.status_code == 400, (field, r.text)
            message = r.json()["error"]["message"]
            assert f"{field} is nested" in message and f"the limit is {MAX_TEMPLATE_DEPTH}" in message
        # at the limit, the template renders it
        at_limit = [{"type": "function", "function": {"name": "f", "parameters": nested(MAX_TEMPLATE_DEPTH - 3)}}]
        assert chat(server, max_tokens=1, tools=at_limit).status_code == 200


def stream_events(r: requests.Response) -> list:
    lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == b"data: [DONE]", lines[-3:]
    return [json.loads(line.removeprefix(b"data: ")) for line in lines[:-1]]


@pytest.mark.parametrize("case", ["nan", "surrogate"])
def test_forced_tool_call_text_that_is_not_strict_json_is_content_in_answers_and_streams(server, case):
    text = NOT_STRICT[case]
    body = {"tools": [TOOL], "regex": re.escape(text), "max_tokens": 80, "temperature": 0}
    with unharmed(server):
        r = chat(server, **body)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        assert message["content"] == text and not message.get("tool_calls")
        events = stream_events(chat(server, stream=True, **body))
        assert not any("error" in e for e in events)
        assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == text
        assert not any(e["choices"][0]["delta"].get("tool_calls") for e in events)


def update(url: str, model_path: str) -> requests.Response:
    return requests.post(url + "/update_weights_from_disk", json={"model_path": model_path}, timeout=20)


def test_a_model_path_too_long_to_name_a_file_is_a_400(server):
    with unharmed(server):
        for path, words in (("x" * 100_000, "limit is 4096"), ("/tmp/" + "x" * 300, "File name too long")):
            r = update(server, path)
            assert r.status_code == 400 and r.json()["error"]["param"] == "model_path", r.text
            assert words in r.json()["error"]["message"]


@pytest.mark.parametrize("fifo", ["model.safetensors", "model.safetensors.index.json", "generation_config.json"])
def test_a_fifo_in_a_weights_directory_is_a_400_naming_it_and_generation_goes_on(server, llama_path, tmp_path, fifo):
    fifo_dir = make_fifo_checkpoint(llama_path, tmp_path / "ckpt", fifo)
    with unharmed(server):
        start = time.monotonic()
        for _ in range(5):  # four stuck reads once filled the tokenizing pool: generation hung, /health said 200
            r = update(server, str(fifo_dir))
            assert r.status_code == 400 and fifo in r.json()["error"]["message"], r.text
        assert time.monotonic() - start < 10


def test_a_safetensors_header_longer_than_its_file_is_a_400(server, llama_path, tmp_path):
    liar = tmp_path / "liar"
    liar.mkdir()
    for f in llama_path.iterdir():
        if f.name != "model.safetensors":
            (liar / f.name).symlink_to(f)
    (liar / "model.safetensors").write_bytes((1 << 20).to_bytes(8, "little") + b"{}")
    with unharmed(server):
        r = update(server, str(liar))
        assert r.status_code == 400 and "model.safetensors is not a safetensors file" in r.json()["message"], r.text

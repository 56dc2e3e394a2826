"""LoRA adapters in the DSL: run(lora_path=...) as the program's default, gen/select's own as the
override, sent as /generate's `lora_path` in every request a call makes (select's scoring ones too).

No server: a RuntimeEndpoint whose HTTP calls stay in the process records each request body.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import radixrt as rt
import support.recording_endpoint
from radixrt.lang.backend import runtime_endpoint

# Each scoring answer gives choice i the logprob -(i + 1) per token, so select picks the first choice.
ENTRY_TEXT = "\x00"  # a token text no prompt ends with: keeps scoring.py's healing step out of the way


def _scored(i: int) -> dict[str, Any]:
    entries = [[-(i + 1.0), 5, ENTRY_TEXT], [-(i + 1.0), 6, ENTRY_TEXT]]
    return {"meta_info": {"input_token_logprobs": entries, "output_token_logprobs": [], "cached_tokens": 0}}


class RecordingEndpoint(support.recording_endpoint.RecordingEndpoint):
    """Answers generation with "7" and scoring with made-up logprobs."""

    def answer(self, body: dict[str, Any]) -> Any:
        batch = body.get("text", body.get("input_ids"))
        if isinstance(batch, list) and batch and not isinstance(batch[0], int):
            return [_scored(i) for i in range(len(batch))]
        return {"text": "7", "meta_info": {"prompt_tokens": 3, "cached_tokens": 0, "completion_tokens": 1}}

    def loras(self) -> list[Any]:
        """Each recorded request's lora_path, in order ("-" where the body has none)."""
        return [b.get("lora_path", "-") for b in self.bodies]


@pytest.fixture
def endpoint() -> RecordingEndpoint:
    return RecordingEndpoint()


@rt.function
def gen_and_select(s):
    s += "Q: " + rt.gen("a", max_tokens=4)
    s += " A: " + rt.select("pick", ["yes", "no"])


def test_without_lora_path_no_request_carries_one(endpoint):
    gen_and_select.run(backend=endpoint)
    assert endpoint.loras() == ["-"] * 3  # gen; select's prefix and scoring requests


def test_run_lora_path_reaches_every_gen_and_select_request(endpoint):
    state = gen_and_select.run(backend=endpoint, lora_path="a1", temperature=0)
    assert state["pick"] == "yes"
    assert endpoint.loras() == ["a1"] * 3
    assert all("lora_path" not in b["sampling_params"] for b in endpoint.bodies)  # a top-level field


def test_gen_and_select_override_the_program_default(endpoint):
    @rt.function
    def prog(s):
        s += rt.gen("plain", max_tokens=2)
        s += rt.gen("own", max_tokens=2, lora_path="g1")
        s += rt.select("sel", ["x", "y"], lora_path="s1")
        s += rt.gen("choice", choices=["x", "y"], lora_path="c1")  # gen's choices are a select

    prog.run(backend=endpoint, lora_path="a1")
    assert endpoint.loras() == ["a1", "g1", "s1", "s1", "c1", "c1"]


def test_per_call_lora_path_without_a_program_default(endpoint):
    @rt.function
    def prog(s):
        s += rt.gen("base", max_tokens=2)
        s += rt.gen("tuned", max_tokens=2, lora_path="g1")

    prog.run(backend=endpoint)
    assert endpoint.loras() == ["-", "g1"]


def test_unconditional_scoring_request_uses_the_adapter_too(endpoint):
    @rt.function
    def prog(s):
        s += "Q:" + rt.select("sel", ["x", "y"], choices_method=rt.unconditional_likelihood_normalized)

    prog.run(backend=endpoint, lora_path="a1")
    assert [("input_ids" in b, b.get("lora_path")) for b in endpoint.bodies] == [
        (False, "a1"), (False, "a1"), (True, "a1")]  # prefix, prefix+choices, choices alone


def test_forks_inherit_the_default_and_the_shared_prefix_is_cached_under_it(endpoint):
    @rt.function
    def prog(s):
        s += "Shared prefix. "
        forks = s.fork(2)
        forks += lambda i: rt.gen("g", max_tokens=2, lora_path="g1" if i else None)
        forks.join()

    prog.run(backend=endpoint, lora_path="a1")
    prefill, *gens = endpoint.bodies
    assert prefill["sampling_params"] == {"max_new_tokens": 0} and prefill["lora_path"] == "a1"
    assert sorted(b["lora_path"] for b in gens) == ["a1", "g1"]


def test_run_batch_lora_path_applies_to_every_item(endpoint):
    @rt.function
    def prog(s, q):
        s += q + rt.gen("a", max_tokens=2)

    states = prog.run_batch([{"q": "a"}, {"q": "b"}, ("c",)], backend=endpoint, lora_path="a1", num_threads=2)
    assert [s["a"] for s in states] == ["7"] * 3
    assert endpoint.loras() == ["a1"] * 3


def test_streamed_gen_sends_lora_path(endpoint, monkeypatch):
    sent: list[dict[str, Any]] = []

    def fake_stream(url: str, body: Any, api_key: Any = None, timeout: Any = None) -> Iterator[dict[str, Any]]:
        sent.append(body)
        yield {"text": "7", "meta_info": {}}

    monkeypatch.setattr(runtime_endpoint.http, "stream", fake_stream)

    @rt.function
    def prog(s):
        s += rt.gen("a", max_tokens=2)

    state = prog.run(backend=endpoint, stream=True, lora_path="a1")
    assert "".join(state.text_iter()) == "7"
    assert [(b["stream"], b["lora_path"]) for b in sent] == [(True, "a1")]


@pytest.mark.parametrize("bad", ["", 3, ["a1"]])
def test_lora_path_must_be_an_adapter_name(bad):
    with pytest.raises(TypeError, match="lora_path must be an adapter's name"):
        rt.gen("a", lora_path=bad)
    with pytest.raises(TypeError, match="lora_path must be an adapter's name"):
        rt.select("a", ["x"], lora_path=bad)
    with pytest.raises(TypeError, match="lora_path must be an adapter's name"):
        gen_and_select.run(backend=RecordingEndpoint(), lora_path=bad)

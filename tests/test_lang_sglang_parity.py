"""radixrt.lang against SGLang's own frontend (sglang 0.5.9, installed in the venv).

The same programs run through both DSLs. Chat templates and stop strings need no
server: both frontends talk to a recorder that answers every /generate with "ok" and
keeps the request bodies. select runs on the shared tiny server, through
sglang.RuntimeEndpoint and through ours, and the scores must agree to 1e-6.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import pytest

import sglang as sgl  # setup_env.sh installs SGLang 0.5.9's frontend: missing, this fails
import sglang.lang.backend.runtime_endpoint as sgl_endpoint_module
from sglang.lang.chat_template import chat_template_registry, get_chat_template_by_model_path

import radixrt.lang as rt  # noqa: E402
from radixrt.lang.chat_template_registry import NOT_CARRIED, TEMPLATES, template_name_for  # noqa: E402

CORPUS = (Path(__file__).resolve().parents[1] / "scripts" / "data" / "corpus.txt").read_text()

MODEL_PATHS = [
    "meta-llama/Llama-2-7b-chat-hf", "meta-llama/Meta-Llama-3-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
    "mistralai/Mistral-7B-Instruct-v0.2", "mistralai/Mixtral-8x7B-Instruct-v0.1", "Qwen/Qwen2.5-7B-Instruct",
    "Qwen/Qwen2-7B-Instruct", "Qwen/Qwen3-8B", "Qwen/Qwen2-VL-7B-Instruct", "google/gemma-2-9b-it",
    "google/gemma-3-4b-pt", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "codellama/CodeLlama-7b-Instruct-hf",
    "lmsys/vicuna-7b-v1.5", "deepseek-ai/DeepSeek-V3", "deepseek-ai/DeepSeek-V3-Base", "01-ai/Yi-1.5-9B-Chat",
    "ibm-granite/granite-3.0-8b-instruct", "CohereForAI/c4ai-command-r-v01", "openbmb/MiniCPM-V-2_6",
    "deepseek-ai/Janus-Pro-7B", "/models/llama-tiny", "some/unknown",
]


# --- both frontends over a recorder ---


class Recorder:
    """What a frontend sent to /generate; answers "ok"."""

    def __init__(self, model_path: str) -> None:
        self.model_path, self.bodies = model_path, []

    def answer(self, path: str, body: Any) -> dict[str, Any]:
        if path.endswith("/get_model_info"):
            return {"model_path": self.model_path}
        self.bodies.append(body)
        return {"text": "ok", "meta_info": {"prompt_tokens": 1, "completion_tokens": 1, "cached_tokens": 0}}

    def generated(self) -> list[tuple[str, list[str]]]:
        """(prompt, stop strings) of each request that generates."""
        sent = [(b["text"], b["sampling_params"].get("stop") or []) for b in self.bodies
                if b["sampling_params"].get("max_new_tokens") != 0]
        return [(text, [stop] if isinstance(stop, str) else list(stop)) for text, stop in sent]


class OurRecordingEndpoint(rt.RuntimeEndpoint):
    def __init__(self, recorder: Recorder, chat_template_name: str | None) -> None:
        self.recorder = recorder
        super().__init__("http://recorder.invalid", chat_template_name=chat_template_name)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        return self.recorder.answer(path, body)


class _SglResponse:
    status_code = 200

    def __init__(self, payload: Any) -> None:
        self.payload = payload

    def json(self) -> Any:
        return self.payload


@pytest.fixture
def sgl_recording(monkeypatch) -> Callable[[Recorder, str | None], Any]:
    """sglang.RuntimeEndpoint with its HTTP calls answered by a Recorder."""
    current: list[Recorder] = []

    def fake_http_request(url: str, json: Any = None, **_: Any) -> _SglResponse:
        return _SglResponse(current[-1].answer(url, json))

    monkeypatch.setattr(sgl_endpoint_module, "http_request", fake_http_request)

    def make(recorder: Recorder, chat_template_name: str | None) -> Any:
        current.append(recorder)
        return sgl.RuntimeEndpoint("http://recorder.invalid", chat_template_name=chat_template_name)

    return make


def programs(lib: ModuleType) -> dict[str, Any]:
    """The same programs written with either DSL (`lib` is sglang or radixrt.lang)."""

    @lib.function
    def chat(s):
        s += lib.system("You are terse.")
        s += lib.user("Name a river.")
        s += lib.assistant(lib.gen("a1", max_tokens=4))
        s += lib.user("  And a lake?")  # messages drop the leading spaces, the text keeps them
        s += lib.assistant(lib.gen("a2", max_tokens=4, stop=["\n", "."]))

    @lib.function
    def no_system(s):  # templates with a default system prompt put it first; Llama 2 opens with [INST]
        s += lib.user("Hello")
        s += lib.assistant(lib.gen("a", max_tokens=4, stop="\n"))

    @lib.function
    def plain(s):  # gens outside any role, with and without their own stop strings
        s += "Q: " + lib.gen("x", max_tokens=4)
        s += "\nR: " + lib.gen("y", max_tokens=4, stop="\n")
        s += "\nS: " + lib.gen("z", max_tokens=4, stop=["<|im_end|>", "!"])

    return {"chat": chat, "no_system": no_system, "plain": plain}


OURS, THEIRS = programs(rt), programs(sgl)


def run_both(sgl_recording, model_path: str, chat_template_name: str | None, name: str,
             **run_args: Any) -> tuple[tuple[Any, Recorder], tuple[Any, Recorder]]:
    mine, theirs = Recorder(model_path), Recorder(model_path)
    our_state = OURS[name].run(backend=OurRecordingEndpoint(mine, chat_template_name), **run_args)
    their_state = THEIRS[name].run(backend=sgl_recording(theirs, chat_template_name), **run_args)
    their_state.sync()  # SGLang's run returns before the program has run
    assert their_state.error() is None, their_state.error()
    return (our_state, mine), (their_state, theirs)


# --- 1. chat templates ---


def test_chat_templates_are_chosen_and_render_as_sglang(sgl_recording):
    carried = [name for name in chat_template_registry if name not in NOT_CARRIED]
    assert sorted(carried) == sorted(TEMPLATES)
    cases = [(path, None) for path in MODEL_PATHS] + [("some/unknown", name) for name in carried]
    for path, template in cases:
        if template is None:
            assert template_name_for(path) == get_chat_template_by_model_path(path).name, path
        for program in ("chat", "no_system"):
            (ours, _), (theirs, _) = run_both(sgl_recording, path, template, program)
            assert ours.text() == theirs.text(), (path, template, program)
            assert ours.messages() == theirs.messages(), (path, template, program)
    # a path SGLang gives a template we leave out is an error that names it, not another template
    with pytest.raises(ValueError, match="dbrx-instruct"):
        OurRecordingEndpoint(Recorder("databricks/dbrx-instruct"), None)


# --- 2. stop strings ---


def test_every_gen_request_carries_the_stop_strings_sglang_sends(sgl_recording):
    for template in sorted(TEMPLATES):
        for program in ("chat", "no_system", "plain"):
            for run_args in ({}, {"stop": "\n\n"}):  # a run-wide stop is the default of each gen's own
                (_, mine), (_, theirs) = run_both(sgl_recording, "some/unknown", template, program, **run_args)
                # each string once (SGLang sends "<|im_end|>" twice when the gen already has it)
                expected = [(text, list(dict.fromkeys(stop))) for text, stop in theirs.generated()]
                assert mine.generated() == expected, (template, program, run_args)
                # in a role or not, every gen stops at the template's end of turn too
                assert all(set(TEMPLATES[template].stop_str) <= set(stop) for _, stop in mine.generated())


# --- 3. select scores, on the shared server ---


def select_program(lib: ModuleType) -> Any:
    @lib.function
    def pick(s, prefix: str, choices: list[str], method: Any):
        s += prefix + lib.select("choice", choices=choices, choices_method=method)

    return pick


METHODS = {"token_length_normalized": (rt.token_length_normalized, sgl.token_length_normalized),
           "greedy_token_selection": (rt.greedy_token_selection, sgl.greedy_token_selection),
           "unconditional_likelihood_normalized": (rt.unconditional_likelihood_normalized,
                                                   sgl.unconditional_likelihood_normalized)}
SELECT_CASES = [  # choices of different token lengths; every method applies
    ("The river runs", [" fast", " slowly", " under the old bridge"]),
    ("The answer is ", ["yes", "no", "maybe not"]),  # BPE merges the prefix's last space into choices
    (CORPUS[:57], ["n hour", " little", "cold"]),
    ("Options:\n\n", ["red", "green and gold", "blue"]),  # the prefix ends with the first scored token: healing
    (CORPUS[300:700], [" kitchen", " street", " delivery van", " honey"]),
]
SHORT_CASE = ("Hi", [" there", " you all", "!"])  # P = 2: scored from position 0, whose logprob is None


class Replay:
    """The server's answers to SGLang's requests, handed out again to identical requests only."""

    def __init__(self) -> None:
        self.exchanges: list[tuple[str, Any, Any]] = []  # (path, body, answer), in order

    def record(self, path: str, body: Any, answer: Any) -> None:
        self.exchanges.append((path, body, answer))

    def answer(self, path: str, body: Any) -> Any:
        for i, (p, b, answer) in enumerate(self.exchanges):
            if (p, b) == (path, body):
                del self.exchanges[i]
                return answer
        raise AssertionError(f"SGLang's frontend sent no such request: {path} {body}")


class OurReplayEndpoint(rt.RuntimeEndpoint):
    """Ours, its /generate calls answered from SGLang's exchanges (other calls reach the server)."""

    def __init__(self, url: str, replay: Replay) -> None:
        self.replay = replay
        super().__init__(url)

    def _call(self, method: str, path: str, body: Any = None) -> Any:
        return self.replay.answer(path, body) if path == "/generate" else super()._call(method, path, body)


@pytest.fixture
def sgl_proxy(monkeypatch, server: str) -> Callable[[Replay], Any]:
    """sglang.RuntimeEndpoint on the server, its /generate exchanges recorded into a Replay."""
    real_http_request = sgl_endpoint_module.http_request
    current: list[Replay] = []

    def recording_http_request(url: str, json: Any = None, **kwargs: Any) -> Any:
        response = real_http_request(url, json=json, **kwargs)
        path = url[len(server):]
        if path != "/generate":
            return response
        assert response.status_code == 200
        answer = response.json()
        current[-1].record(path, json, answer)
        return _SglResponse(answer)

    monkeypatch.setattr(sgl_endpoint_module, "http_request", recording_http_request)

    def make(replay: Replay) -> Any:
        current.append(replay)
        return sgl.RuntimeEndpoint(server)

    return make


def test_select_scores_and_choices_equal_sglangs(server, sgl_proxy):
    """SGLang's frontend runs each select on the server; ours then gets the very same answers, and only
    if it sends the very same requests (the server's fp32 logprobs move by an ulp, ~1e-6, between two runs
    of one request as its batch changes, so two live runs would compare the server, not the frontends)."""
    ours, theirs = select_program(rt), select_program(sgl)
    runs = [(case, name) for case in SELECT_CASES for name in METHODS] + [(SHORT_CASE, "token_length_normalized")]
    for (prefix, choices), name in runs:
        replay, (our_method, their_method) = Replay(), METHODS[name]
        their_state = theirs.run(prefix=prefix, choices=choices, method=their_method, backend=sgl_proxy(replay))
        their_state.sync()  # SGLang's run returns before the program has run
        assert their_state.error() is None, their_state.error()
        our_state = ours.run(prefix=prefix, choices=choices, method=our_method,
                             backend=OurReplayEndpoint(server, replay))
        case = (prefix[-20:], choices, name)
        assert replay.exchanges == [], case  # and no request of SGLang's went unasked
        assert our_state["choice"] == their_state["choice"], case
        assert our_state.text() == their_state.text() == prefix + our_state["choice"]
        mine, theirs_meta = our_state.get_meta_info("choice"), their_state.get_meta_info("choice")
        assert mine["normalized_prompt_logprobs"] == pytest.approx(theirs_meta["normalized_prompt_logprobs"],
                                                                   rel=0, abs=1e-6), case
        for key, value in theirs_meta.items():  # the tokens scored, and each method's extras
            assert mine[key] == pytest.approx(value, rel=0, abs=1e-6) if "normalized" in key else mine[key] == value, \
                (case, key)
        if prefix == "Options:\n\n":  # scored from the first "\n", which the healing step drops
            assert [e[2] for e in mine["input_token_logprobs"][0]] == ["\n", "red"]

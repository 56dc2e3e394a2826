"""The DSL (radixrt.lang) end to end: programs against one real server on the tiny model."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest

import radixrt as rt
from support.helpers import hf_logprobs, process_alive, tokenizer
from radixrt.lang import ProgramError
from radixrt.lang.backend.base import GenOutput, SelectOutput
from radixrt.lang.chat_template_registry import get_chat_template
from radixrt.lang.choices import ChoicesMethod
from radixrt.lang.scoring import logprob_start, score_choice
from support.server_proc import SERVER_PAGE_SIZE

ROOT = Path(__file__).resolve().parents[1]
PAGE = SERVER_PAGE_SIZE  # of `server` (conftest.py), the session's shared server
CORPUS = (ROOT / "scripts" / "data" / "corpus.txt").read_text()


@pytest.fixture(scope="module")
def backend(server: str) -> rt.RuntimeEndpoint:
    return rt.RuntimeEndpoint(server)


def test_import_lang_loads_no_runtime():
    code = ("import sys, radixrt; import radixrt.lang; import radixrt as rt; rt.gen, rt.Runtime; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules; "
            "assert {m for m in sys.modules if m.startswith('radixrt') and not m.startswith('radixrt.lang')} "
            "<= {'radixrt', 'radixrt.config', 'radixrt.reasoning'}; print('ok')")  # reasoning: separate_reasoning's
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


@rt.function
def complete(s, prompt: str, limit: int, stop_at: str | None) -> None:
    s += prompt + rt.gen("out", max_tokens=limit, stop=stop_at, temperature=0)


def test_gen_honors_max_tokens_and_stop(backend):
    prompt = CORPUS[:200]
    for limit in (3, 24):
        state = complete.run(prompt=prompt, limit=limit, stop_at=None, backend=backend)
        assert state.get_meta_info("out")["completion_tokens"] <= limit
    free = state["out"]
    # a stop string cut from the middle of the greedy output: the same run must end right before it
    start = next(i for i in range(len(free) // 3, len(free) - 3) if free[i:i + 3].isascii() and free[i:i + 3].strip())
    stop = free[start:start + 3]
    stopped = complete.run(prompt=prompt, limit=24, stop_at=stop, backend=backend)
    assert stop not in stopped["out"]
    assert stopped["out"] == free[:free.index(stop)]
    assert stopped.text() == prompt + stopped["out"]


@rt.function
def pick(s, prefix: str, choices: list[str]) -> None:
    s += prefix + rt.select("choice", choices)


def reference_scores(path: Path, prefix: str, choices: list[str]) -> list[float]:
    """Each choice's score by select's rule (radixrt/lang/scoring.py, SGLang's), from transformers' logprobs:
    the entries of prefix+choice from logprob_start(P) on, P = the prefix's own token count."""
    tok, scores = tokenizer(path), []
    start = logprob_start(len(tok(prefix)["input_ids"]))
    for choice in choices:
        ids = tok(prefix + choice)["input_ids"]
        logprobs = hf_logprobs(path, ids)  # [len(ids), vocab]
        entries = [[logprobs[k - 1, ids[k]].item() if k else None, ids[k], tok.decode([ids[k]])]
                   for k in range(start, len(ids))]
        scores.append(score_choice(prefix, entries).normalized)
    return scores


SELECT_CASES = [
    ("The river runs", [" fast", " slowly", " under the old bridge"]),
    ("The answer is ", ["yes", "no", "maybe"]),  # BPE merges the space into each choice's first token
    (CORPUS[:57], ["n hour", " little", "cold"]),  # "...to hum a" + "n hour": " an" straddles
    ("<|im_start|>user\nPick a color<|im_end|>\n<|im_start|>assistant\n", ["red", "green", "blue", "purple"]),
    (CORPUS[300:700], [" kitchen", " street", " delivery van", " honey"]),
]


def test_select_picks_the_best_choice_as_transformers_scores_it(backend, llama_path):
    for prefix, choices in SELECT_CASES:
        state = pick.run(prefix=prefix, choices=choices, backend=backend)
        ref = reference_scores(llama_path, prefix, choices)
        best = max(range(len(choices)), key=lambda i: ref[i])
        assert state["choice"] == choices[best], (prefix, choices, ref)
        assert state.text() == prefix + choices[best]
        got = state.get_meta_info("choice")["normalized_prompt_logprobs"]
        assert got == pytest.approx(ref, abs=2e-3), (prefix, choices)


def test_scoring_rule():
    # the mean of the truthy logprobs: None (no logprob) and an exact 0.0 are left out, as SGLang's `if x[0]`
    entries = [[None, 1, "<s>"], [-1.0, 2, " The"], [0.0, 3, " answer"], [-3.0, 4, " yes"]]
    assert score_choice("The answer is ", entries).normalized == -2.0
    # healing: the prefix ends with the first entry's text, so it leaves the average and the entries
    entries = [[-1.0, 1, " is"], [-2.0, 2, ":"], [-6.0, 3, " yes"]]
    healed = score_choice("The answer is", entries)
    assert healed.normalized == -4.0 and healed.entries == entries[1:]
    unhealed = score_choice("The answer is:", entries)
    assert unhealed.normalized == -3.0 and unhealed.entries == entries
    with pytest.raises(ValueError, match="no token with a logprob"):
        score_choice("x", [[None, 1, "<s>"]])


def shared_prefix(tokens_wanted: int) -> str:
    return CORPUS[1000:1000 + 5 * tokens_wanted] + "\n"


@rt.function
def four_ways(s, prefix: str) -> None:
    s += prefix
    forks = s.fork(4)
    forks += lambda i: f"Branch {i}: "
    forks += rt.gen("idea", max_tokens=8, temperature=1.0)
    forks += [rt.gen(f"own_{i}", max_tokens=2) for i in range(4)]
    s["prefix_meta"] = forks.prefix_meta
    s["branch_texts"] = [f.text() for f in forks]
    s["own_vars"] = [[name for name in ("own_0", "own_1", "own_2", "own_3") if name in f] for f in forks]
    forks.join()


def test_fork_branches_are_independent_and_share_the_prefix_once(backend):
    backend.flush_cache()
    before = backend.get_server_info()
    prefix = shared_prefix(250)
    state = four_ways.run(prefix=prefix, backend=backend)
    after = backend.get_server_info()

    texts = state["branch_texts"]
    assert len(set(texts)) == 4
    assert all(t.startswith(prefix + f"Branch {i}: ") for i, t in enumerate(texts))
    assert state["own_vars"] == [["own_0"], ["own_1"], ["own_2"], ["own_3"]]
    assert len(state["idea"]) == 4 and state["own_2"][2] is not None and state["own_2"][0] is None
    assert state.text() == prefix  # gather_variable leaves the parent's text alone

    hint = state["prefix_meta"]  # the prefill-only request fork sent before the branches
    shared = hint["prompt_tokens"]
    assert shared >= 200 and hint["cached_tokens"] == 0 and hint["completion_tokens"] == 0
    for meta in state.get_meta_info("idea"):
        assert meta["cached_tokens"] >= shared - PAGE, meta
    computed = (after["prompt_tokens"] - before["prompt_tokens"]) - (
        after["cached_prompt_tokens"] - before["cached_prompt_tokens"])
    assert computed <= shared + 4 * 3 * PAGE, (computed, shared)  # the prefix once, not four times


@rt.function
def echo(s, i: int) -> None:
    s += f"Item {i}: " + rt.gen("x", max_tokens=4, temperature=0)
    s["i"] = i


def test_run_batch_returns_states_in_input_order(backend):
    states = echo.run_batch([{"i": i} for i in range(32)], backend=backend, progress_bar=True)
    assert len(states) == 32
    for i, state in enumerate(states):
        assert state["i"] == i
        assert state.text() == f"Item {i}: " + state["x"]
    again = echo.run_batch([(i,) for i in (5, 6)], backend=backend, num_threads=1)
    assert [s.text() for s in again] == [states[5].text(), states[6].text()]


@rt.function
def story(s, topic: str) -> None:
    s += rt.user(f"Tell me about {topic}.")
    s += rt.assistant(rt.gen("story", max_tokens=24, temperature=0, ignore_eos=True))


def test_streamed_chunks_join_into_the_final_text(backend):
    state = story.run(topic="ferries", stream=True, backend=backend)
    chunks = list(state.text_iter())
    assert len(chunks) > 5 and "".join(chunks) == state.text()
    story_chunks = list(state.text_iter("story"))
    assert len(story_chunks) > 1 and "".join(story_chunks) == state["story"]
    assert story.run(topic="ferries", backend=backend)["story"] == state["story"]

    async def collect() -> tuple[list[str], Any]:
        s = story.run(topic="bees", stream=True, backend=backend)
        return [c async for c in s.text_async_iter()], s

    chunks, state = asyncio.run(collect())
    assert len(chunks) > 5 and "".join(chunks) == state.text()


@rt.function
def constrained(s) -> None:
    s += "Digits: " + rt.gen("n", max_tokens=4, regex=r"([0-9])\1")  # Python takes it; the server's grammars refuse it


@rt.function
def too_long(s, n: int) -> None:
    s += "word " * n + rt.gen("x", max_tokens=4)


def test_server_errors_raise_with_the_server_message(backend):
    with pytest.raises(rt.RuntimeEndpointError, match="regex") as err:
        constrained.run(backend=backend)
    assert err.value.status == 400 and "Backreference is not supported" in err.value.message
    with pytest.raises(rt.RuntimeEndpointError, match="context length"):
        too_long.run(n=5000, backend=backend)
    states = too_long.run_batch([{"n": 3}, {"n": 5000}, {"n": 4}], backend=backend)
    assert states[0].error() is None and states[2].error() is None
    assert isinstance(states[1].error(), rt.RuntimeEndpointError)
    with pytest.raises(rt.RuntimeEndpointError):
        states[1].text()


@rt.function
def chat(s) -> None:
    s += rt.system("You are brief.")
    with s.user():
        s += "Name a "
        s += "river."
    s += rt.assistant(rt.gen("reply", max_tokens=12, temperature=0))


def test_roles_render_with_the_chat_template(server, backend, llama_path):
    assert backend.chat_template.name == "default"  # SGLang's choice for a path it does not know
    chatml = rt.RuntimeEndpoint(server, chat_template_name="chatml")  # the tiny model's own template
    state = chat.run(backend=chatml)
    messages = [
        {"role": "system", "content": "You are brief."},
        {"role": "user", "content": "Name a river."},
        {"role": "assistant", "content": state["reply"]},
    ]
    assert state.text() == tokenizer(llama_path).apply_chat_template(messages, tokenize=False)
    messages[2]["content"] = state["reply"].lstrip()  # a message drops the turn's leading whitespace (SGLang's)
    assert state.messages() == messages
    assert "<|im_end|>" not in state["reply"]


class RecordingBackend:
    """A stand-in backend that records each gen's settings and answers "ok"."""

    chat_template = get_chat_template("chatml")

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def generate(self, prompt: str, params: Any) -> GenOutput:
        self.calls.append((prompt, params))
        return GenOutput("ok", {})

    def generate_stream(self, prompt: str, params: Any) -> Iterator[GenOutput]:
        yield self.generate(prompt, params)

    def cache_prefix(self, prompt: str) -> dict:
        return {}

    def select(self, prompt: str, choices: Any, method: ChoicesMethod) -> SelectOutput:
        return SelectOutput(0, choices[0], {})


def test_every_gen_stops_at_end_of_turn_and_roles_do_not_nest():
    @rt.function
    def prog(s):
        s += rt.gen("plain", stop="\n")
        s += rt.assistant(rt.gen("turn", stop="\n", temperature=0.5))

    fake = RecordingBackend()
    state = prog.run(backend=fake, max_new_tokens=7, temperature=0.1)
    (_, plain), (_, turn) = fake.calls
    assert plain.stop == turn.stop == ("\n", "<|im_end|>")  # in a role or not, as SGLang
    assert (plain.max_new_tokens, plain.temperature, turn.temperature) == (7, 0.1, 0.5)
    assert state.text() == "ok<|im_start|>assistant\nok<|im_end|>\n"

    @rt.function
    def nested(s):
        with s.user():
            s += rt.assistant("hi")

    with pytest.raises(ProgramError, match="do not nest"):
        nested.run(backend=fake)


def test_runtime_starts_a_server_and_shuts_it_down(llama_path):
    with rt.Runtime(model_path=str(llama_path), page_size=PAGE, max_total_tokens=4096) as runtime:
        assert runtime.url.startswith("http://127.0.0.1:")
        state = echo.run(i=7, backend=runtime)
        assert state.text().startswith("Item 7: ")
        pid = runtime.process.pid
    assert not process_alive(pid)

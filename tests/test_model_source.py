"""Model sources as SGLang takes them: Hugging Face repo ids through the cache (offline),
--revision, chat templates by name or file, generation_config.json sampling defaults, the
dtype rule, and SGLang's flag spellings (torch_native, --enable-metrics)."""

from __future__ import annotations

import argparse
import json
import os
import types
from pathlib import Path

import huggingface_hub
import pytest
import requests
from support.helpers import tokenizer
from support.server_proc import running_server

from radixrt.cli_args import add_server_args, server_args_from
from radixrt.config import ServerArgs
from radixrt.settings.chat import CHAT_TEMPLATE_NAMES
from radixrt.frontend.sampling_defaults import model_sampling_defaults, with_defaults
from radixrt.model_source import Hub, local_dir, resolve_model_source, tokenizer_gap
from radixrt.models.dtype import resolve_dtype
from radixrt.sampling_params import SamplingParamsIn
from radixrt.server.chat_templates import NAMED_TEMPLATES

REPO, CONFIG_ONLY = "radixrt-test/tiny-llama", "radixrt-test/config-only"
MAIN, V1 = "a" * 40, "b" * 40  # commits: refs/main -> MAIN, refs/v1 (a tag) -> V1
V1_GENERATION = {"temperature": 0.0, "max_new_tokens": 3, "do_sample": True, "top_p": None}  # V1 only: greedy chats
CHATML_STOP = ["<|endoftext|>", "<|im_end|>"]


def _snapshot(cache: Path, repo: str, commit: str, refs: list[str], files: dict[str, Path | str]) -> Path:
    """One snapshot laid out as huggingface_hub lays it out: files link into it, refs name its commit."""
    root = cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    for name, src in files.items():
        if isinstance(src, Path):
            (snap / name).symlink_to(src)
        else:
            (snap / name).write_text(src)
    (root / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (root / "refs" / ref).write_text(commit)
    return snap


@pytest.fixture(scope="module")
def cache(tmp_path_factory, llama_path) -> Path:
    """An HF cache: REPO at MAIN (the tiny llama) and V1 (the same with sampling defaults), and a
    snapshot holding only a config.json (what AutoConfig alone leaves in a cache)."""
    cache = tmp_path_factory.mktemp("hf-cache")
    files = {f.name: f for f in llama_path.iterdir()}
    _snapshot(cache, REPO, MAIN, ["main"], files)
    generation = {**json.loads((llama_path / "generation_config.json").read_text()), **V1_GENERATION}
    _snapshot(cache, REPO, V1, ["v1"], {**files, "generation_config.json": json.dumps(generation)})
    _snapshot(cache, CONFIG_ONLY, MAIN, ["main"], {"config.json": llama_path / "config.json"})
    return cache


@pytest.fixture
def offline(cache, monkeypatch) -> Hub:
    """The cache for servers started from here (they inherit the environment), network off."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return Hub(cache, offline=True)


# --- resolving names ---------------------------------------------------------------------------


@pytest.mark.parametrize(("revision", "commit"), [(None, MAIN), ("main", MAIN), ("v1", V1), (V1, V1)])
def test_a_repo_id_resolves_to_the_snapshot_its_revision_names(offline, revision, commit):
    args = ServerArgs(model_path=REPO, revision=revision, tokenizer_path=REPO)
    local = resolve_model_source(args, offline)
    assert Path(local.model_path) == offline.cache_dir / f"models--radixrt-test--tiny-llama/snapshots/{commit}"
    assert local.tokenizer_path == local.model_path
    assert local.model_name == REPO  # what users see stays what they typed


@pytest.mark.parametrize(("name", "revision", "says"), [
    ("radixrt-test/absent", None, ["'radixrt-test/absent'", "revision main", "not in the cache"]),
    (REPO, "v2", ["revision v2", "not in the cache"]),
    (CONFIG_ONLY, None, [MAIN, "has no *.safetensors weights"]),
])
def test_what_the_cache_lacks_is_one_error_naming_repo_revision_and_cache(offline, name, revision, says):
    with pytest.raises(ValueError) as e:
        resolve_model_source(ServerArgs(model_path=name, revision=revision), offline)
    message = str(e.value)
    for part in ["model_path", name, str(offline.cache_dir), "HF_HUB_OFFLINE", *says]:
        assert part in message, message


def test_local_directories_are_taken_as_they_are(tmp_path, llama_path, offline):
    assert local_dir(str(llama_path), "v1", "model_path", tokenizer_gap, [], offline) == llama_path.resolve()
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model_source(ServerArgs(model_path=str(tmp_path)), offline)
    with pytest.raises(ValueError, match=r"is not a local directory \(nor a Hugging Face repo id\)"):
        resolve_model_source(ServerArgs(model_path=str(tmp_path / "missing")), offline)


def test_a_miss_downloads_when_the_network_is_allowed_and_says_why_it_failed(tmp_path, llama_path, monkeypatch):
    """snapshot_download stands in for the Hub: the cache is tried first (local_files_only), then
    the download, with the revision; a failed download is the start error, with its reason."""
    calls = []

    def fake_download(repo_id, *, revision=None, cache_dir=None, local_files_only=False, **kw):
        calls.append((repo_id, revision, local_files_only))
        if local_files_only:
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        if repo_id == REPO:
            return str(_snapshot(Path(cache_dir), repo_id, V1, [revision], {"config.json": llama_path / "config.json",
                                 "model.safetensors": llama_path / "model.safetensors"}))
        raise ConnectionError("no route to\nhuggingface.co")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    hub = Hub(tmp_path, offline=False)
    local = resolve_model_source(ServerArgs(model_path=REPO, revision="v1"), hub)
    assert Path(local.model_path) == tmp_path / f"models--radixrt-test--tiny-llama/snapshots/{V1}"
    assert calls == [(REPO, "v1", True), (REPO, "v1", False)]
    with pytest.raises(ValueError, match="downloading it failed: ConnectionError: no route to huggingface.co$"):
        resolve_model_source(ServerArgs(model_path="radixrt-test/absent"), hub)


# --- sampling defaults, dtype, flags ----------------------------------------------------------


def test_generation_config_gives_five_keys_and_openai_none(tmp_path):
    config = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": None,
              "max_new_tokens": 3, "do_sample": True, "eos_token_id": 2}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    assert model_sampling_defaults(tmp_path, "model") == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    assert model_sampling_defaults(tmp_path, "openai") == {}
    assert model_sampling_defaults(tmp_path / "elsewhere", "model") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(ValueError, match="generation_config.json has a sampling default this server refuses.*top_p"):
        model_sampling_defaults(tmp_path, "model")


def test_request_values_win_over_the_defaults():
    defaults = {"temperature": 0.6, "top_k": 20}
    filled = with_defaults(SamplingParamsIn(temperature=1.0, top_p=0.5), defaults)
    assert (filled.temperature, filled.top_k, filled.top_p) == (1.0, 20, 0.5)


@pytest.mark.parametrize(("config", "model_type", "device", "requested", "expected"), [
    ("float32", "llama", "cuda", "auto", "float16"),
    (None, "qwen2", "cuda", "auto", "float16"),  # no dtype in config.json: float32
    ("float32", "gemma2", "cuda", "auto", "bfloat16"),
    ("float32", "gemma", "cuda", "auto", "bfloat16"),
    ("bfloat16", "llama", "cuda", "auto", "bfloat16"),
    ("half", "llama", "cuda", "auto", "float16"),
    ("float32", "llama", "cpu", "auto", "float32"),  # CPU keeps config.json's (bench/dtype_cpu.py)
    ("bfloat16", "gemma2", "cpu", "auto", "bfloat16"),
    ("float32", "llama", "cuda", "float32", "float32"),
])
def test_auto_dtype_follows_sglang_on_cuda_and_the_config_on_cpu(config, model_type, device, requested, expected):
    assert resolve_dtype(config, model_type, device, requested) == expected


def test_sglang_spellings_of_flags_are_accepted(llama_path):
    parser = argparse.ArgumentParser()
    add_server_args(parser)
    args = server_args_from(parser.parse_args(["--model-path", str(llama_path), "--enable-metrics",
                                               "--attention-backend", "torch_native", "--chat-template", "gemma-it"]))
    assert (args.enable_metrics, args.attention_backend, args.chat_template) == (True, "torch", "gemma-it")
    with pytest.raises(ValueError, match="sampling_defaults must be one of model, openai"):
        ServerArgs(model_path="x", sampling_defaults="vllm")


# --- chat templates by name ------------------------------------------------------------------

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": " Hello! "}, {"role": "user", "content": "Again?"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "system", "content": "late"},
     {"role": "user", "content": ""}],
]


def sglang_text(name: str, messages: list[dict]) -> tuple[str, list[str]]:
    """The text and stop strings SGLang 0.5.9 makes of a conversation with template `name`."""
    from sglang.srt.parser.conversation import chat_templates, generate_chat_conv

    if name in chat_templates:
        request = types.SimpleNamespace(messages=[types.SimpleNamespace(**m) for m in messages])
        stop = chat_templates[name].stop_str or []
        return generate_chat_conv(request, name).get_prompt(), [stop] if isinstance(stop, str) else list(stop)
    from sglang.lang.chat_template import get_chat_template  # the frontend's registry: qwen, llama-3-instruct

    template = get_chat_template(name)
    if messages[0]["role"] != "system":
        messages = [{"role": "system", "content": None}, *messages]  # its default system prompt
    return template.get_prompt(messages) + template.role_prefix_and_suffix["assistant"][0], list(template.stop_str)


@pytest.mark.parametrize("name", sorted(NAMED_TEMPLATES))
def test_each_named_template_renders_sglangs_text(name, llama_path):
    tok, ours = tokenizer(llama_path), NAMED_TEMPLATES[name]
    for messages in CONVERSATIONS:
        text, stop = sglang_text(name, messages)
        assert tok.apply_chat_template(messages, chat_template=ours.source, add_generation_prompt=True,
                                       tokenize=False) == text
    assert list(ours.stop) == stop
    assert ours.stops_with("END") == [*stop, "END"]
    with pytest.raises(Exception, match="not tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], chat_template=ours.source, tokenize=False)


def test_the_names_config_accepts_are_the_registered_ones(tmp_path):
    assert sorted(CHAT_TEMPLATE_NAMES) == sorted(NAMED_TEMPLATES)
    with pytest.raises(ValueError, match="neither a file nor a template name.*chatml, qwen"):
        ServerArgs(model_path="x", chat_template="chatm")
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    assert ServerArgs(model_path="x", chat_template=str(tmp_path / "t.jinja")).chat_template.endswith("t.jinja")


def test_the_chat_prompt_of_a_named_template_and_of_a_file(tmp_path, llama_path):
    """A name: SGLang's text, encoded as a prompt; a file: the tokenizer's own chat-template path."""
    import msgspec

    from radixrt.frontend.text_bound import TextBound
    from radixrt.server.openai_api import _chat_ids
    from radixrt.server.schemas import ChatCompletionRequest

    tok = tokenizer(llama_path)
    body = msgspec.convert({"messages": CONVERSATIONS[1]}, ChatCompletionRequest)
    for arg in ("gemma-it", "llama-2"):
        ctx = types.SimpleNamespace(args=ServerArgs(model_path=str(llama_path), chat_template=arg),
                                    intake=types.SimpleNamespace(tokenizer=tok, text_bound=TextBound(4096, 16)))
        assert _chat_ids(ctx, body, None) == tok.encode(sglang_text(arg, CONVERSATIONS[1])[0])
    template = tmp_path / "chat.jinja"
    template.write_text(NAMED_TEMPLATES["llama-3-instruct"].source)
    ctx = types.SimpleNamespace(args=ServerArgs(model_path=str(llama_path), chat_template=str(template)),
                                intake=types.SimpleNamespace(tokenizer=tok, text_bound=TextBound(4096, 16)))
    assert _chat_ids(ctx, body, None) == tok.apply_chat_template(
        CONVERSATIONS[1], chat_template=template.read_text(), add_generation_prompt=True, tokenize=True, return_dict=False)


# --- a server started from the cache, network off ------------------------------------------------

SERVER_FLAGS = ("--page-size", "16", "--max-total-tokens", "4096")


def _chat(url: str, **body) -> dict:
    body = {"messages": [{"role": "user", "content": "Tell me about the river"}], "max_tokens": 8, **body}
    r = requests.post(f"{url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _generate(url: str, ids: list[int], **params) -> str:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 8, **params}}
    r = requests.post(f"{url}/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["text"]


def test_a_server_on_a_repo_id_at_a_tag_with_a_named_template_and_the_models_defaults(offline, llama_path):
    """--revision v1's generation_config.json makes an unset temperature greedy; a request's own wins."""
    with running_server(REPO, "--revision", "v1", "--tokenizer-path", REPO, "--chat-template", "chatml",
                        "--enable-metrics", "--attention-backend", "torch_native", *SERVER_FLAGS) as (url, _):
        info = requests.get(f"{url}/get_model_info", timeout=10).json()
        assert (info["model_path"], info["tokenizer_path"]) == (REPO, REPO)
        assert requests.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"] == REPO
        text = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                "<|im_start|>user\nTell me about the river<|im_end|>\n<|im_start|>assistant\n")
        ids = tokenizer(llama_path).encode(text)
        chat = _chat(url)
        assert chat["usage"]["prompt_tokens"] == len(ids)
        greedy = _generate(url, ids, temperature=0, stop=CHATML_STOP)
        assert chat["choices"][0]["message"]["content"] == greedy
        sampled = _generate(url, ids, temperature=1.0, seed=7, stop=CHATML_STOP)
        assert sampled != greedy  # so the next line tells the two apart
        assert _chat(url, temperature=1.0, seed=7)["choices"][0]["message"]["content"] == sampled
        assert requests.get(f"{url}/metrics", timeout=10).status_code == 200
        assert requests.get(f"{url}/get_server_info", timeout=10).json()["attention_backend"] == "torch"
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # nothing above could reach the network

"""Issue 37: many LoRA adapters on one engine, against transformers + peft with each adapter
merged (tests/support/lora_adapters.py: random PEFT adapters, init_lora_weights=False).

- One step serves the base model and three adapters together, greedy tokens equal to the
  merged references, at page size 1 (with one adapter fewer per step than the batch asks for,
  and fewer slots than adapters, so the per-step cap and the slot eviction both run) and at
  page size 16 under tp 2 (tests/test_model_families.py runs every family's adapter at page
  size 1 or 16 at tp 1, and tests/test_lora_api.py serves three at page size 16).
- The prefix cache: full reuse within an adapter, none across adapters or with the base model.
- Load, unload and reload at run time while requests run: a new adapter under an old name
  never reads the old one's KV; nothing leaks.
- Errors name the adapter; speculative decoding and quantized weights are refused by name.
"""

from __future__ import annotations

import concurrent.futures
import functools

import pytest
from support.helpers import assert_no_page_leak, corpus_prompts
from support.lora_adapters import ensure_adapter, reference_greedy

import radixrt
from radixrt.config import ServerArgs
from radixrt.ops.estimate import estimate
from radixrt.ops.sizing import Workload

SEEDS = {"a1": 1, "a2": 2, "a3": 3}
NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0}
LENGTHS = [6, 23, 41]  # one prompt shorter than a page of 16, two past it
# page 1: 3 adapters in the batch but 2 slots (so 2 per step), and room for the 4 the module registers
CONFIGS = {
    "page1": dict(page_size=1, max_loras_per_batch=2, max_loaded_loras=4),
    "tp2": dict(page_size=16, tp_size=2),
}


@functools.cache
def adapter(base, name: str, seed: int):
    return ensure_adapter(base, name, seed=seed)


def lora_paths(base) -> list[str]:
    return [f"{n}={adapter(base, n, s)}" for n, s in SEEDS.items()]


@functools.cache
def expected(base, name: str | None, ids: tuple[int, ...]) -> tuple[int, ...]:
    path = adapter(base, name, SEEDS[name]) if name is not None else None
    return tuple(reference_greedy(base, path, list(ids), NEW))


def mixed_batch(base) -> tuple[list[list[int]], list[str | None]]:
    """Every prompt under the base model and each adapter, interleaved."""
    ids, names = [], []
    for p in corpus_prompts(base, LENGTHS, seed=37):
        for name in (None, *SEEDS):
            ids.append(p)
            names.append(name)
    return ids, names


def check_mixed_batch(engine, base) -> None:
    ids, names = mixed_batch(base)
    want = [list(expected(base, n, tuple(p))) for p, n in zip(ids, names)]
    got = engine.generate(input_ids=ids, sampling_params=GREEDY, lora_path=names)
    assert [g["output_ids"] for g in got] == want
    base_answer = {tuple(p): w for p, n, w in zip(ids, names, want) if n is None}
    for name in SEEDS:  # each adapter changes the answer of at least one prompt
        assert any(w != base_answer[tuple(p)] for p, n, w in zip(ids, names, want) if n == name), name


def references_first(base) -> None:
    """transformers runs before the engine starts: the two would share the cores."""
    ids, names = mixed_batch(base)
    for p, n in zip(ids, names):
        expected(base, n, tuple(p))


@pytest.fixture(scope="module")
def engine(llama_path):
    references_first(llama_path)
    with radixrt.Engine(model_path=str(llama_path), lora_paths=lora_paths(llama_path), max_total_tokens=8192,
                        **CONFIGS["page1"]) as e:
        yield e


def test_mixed_batch_page1_with_fewer_slots_and_steps_than_adapters(engine, llama_path):
    check_mixed_batch(engine, llama_path)
    info = engine.get_server_info()
    assert info["lora_adapters"] == 3 and all(info[f"lora_requests_{n}"] == len(LENGTHS) for n in SEEDS)
    # `radixrt estimate` counts the adapter slots the worker allocated
    args = ServerArgs(model_path=str(llama_path), lora_paths=lora_paths(llama_path), **CONFIGS["page1"])
    assert estimate(args, Workload(100.0)).breakdown.lora_bytes == info["lora_pool_bytes"] > 0
    assert_no_page_leak(engine)


@pytest.mark.parametrize("config", ["tp2"])  # page 16 at tp 1: tests/test_model_families.py, half the families
def test_mixed_batch(llama_path, config):
    references_first(llama_path)
    with radixrt.Engine(model_path=str(llama_path), lora_paths=lora_paths(llama_path), max_total_tokens=8192,
                        **CONFIGS[config]) as e:
        check_mixed_batch(e, llama_path)
        assert_no_page_leak(e)


def test_prefix_reuse_within_an_adapter_never_across(engine, llama_path):
    prompt = corpus_prompts(llama_path, [40], seed=371)[0]

    def cached(name: str | None) -> int:
        return engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path=name)["meta_info"]["cached_tokens"]

    assert cached("a1") == 0
    assert cached("a1") == len(prompt) - 1  # all but the last token, whose logits are needed
    assert cached("a2") == 0 and cached(None) == 0
    assert cached("a2") == len(prompt) - 1
    assert_no_page_leak(engine)


def test_load_unload_and_reload_under_load(engine, llama_path):
    """While base and a1 requests run: load a4, serve it, unload it, and load other weights under
    its name; the new a4 gives its own references and reads none of the old a4's KV."""
    prompt = corpus_prompts(llama_path, [30], seed=372)[0]
    old, new = adapter(llama_path, "a4", 4), adapter(llama_path, "a4", 5)
    want_old, want_new = (reference_greedy(llama_path, p, prompt, NEW) for p in (old, new))
    background = [corpus_prompts(llama_path, [20], seed=380 + i)[0] for i in range(12)]
    engine.generate(input_ids=[prompt] * 3, sampling_params=GREEDY, lora_path=list(SEEDS))  # a1..a3 fill the slots
    loads = engine.get_server_info()["lora_loads"]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        load = pool.submit(engine.generate, input_ids=background, sampling_params={**GREEDY, "max_new_tokens": 24, "ignore_eos": True},
                           lora_path=[None, "a1"] * 6)
        assert engine.load_lora_adapter("a4", str(old))["success"]
        assert engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a4")["output_ids"] == want_old
        reply = engine.unload_lora_adapter("a4")
        assert reply["success"] and "a4" not in reply["loaded_adapters"]
        assert engine.load_lora_adapter("a4", str(new))["success"]
        got = engine.generate(input_ids=prompt, sampling_params=GREEDY, lora_path="a4")
        assert got["output_ids"] == want_new and got["meta_info"]["cached_tokens"] == 0
        assert all(len(r["output_ids"]) == 24 for r in load.result())
    assert engine.unload_lora_adapter("a4")["success"]
    again = engine.generate(input_ids=[prompt] * 2, sampling_params=GREEDY, lora_path=["a2", "a3"])
    assert [r["output_ids"] for r in again] == [list(expected(llama_path, n, tuple(prompt))) for n in ("a2", "a3")]
    # 2 slots, one of them a1's while it ran: the old a4, the new a4, a2 and a3 each took the other
    assert engine.get_server_info()["lora_loads"] - loads >= 4
    assert_no_page_leak(engine)


def test_errors_name_the_adapter(engine, llama_path, tmp_path):
    with pytest.raises(ValueError, match="nope"):
        engine.generate(input_ids=[5, 6, 7], sampling_params=GREEDY, lora_path="nope")
    reply = engine.load_lora_adapter("empty", str(tmp_path))
    assert not reply["success"] and "'empty'" in reply["error_message"]
    wide = ensure_adapter(llama_path, "wide", seed=6, r=16)
    reply = engine.load_lora_adapter("wide", str(wide))
    assert not reply["success"] and "'wide'" in reply["error_message"] and "rank 16" in reply["error_message"]
    reply = engine.unload_lora_adapter("nope")
    assert not reply["success"] and "nope" in reply["error_message"]
    reply = engine.load_lora_adapter("a1", str(adapter(llama_path, "a1", 1)))
    assert not reply["success"] and "a1" in reply["error_message"]
    assert_no_page_leak(engine)


@pytest.mark.parametrize("flag", [dict(speculative_algorithm="NGRAM"), dict(quantization="w8a8_int8")])
def test_speculative_decoding_and_quantized_weights_are_refused_by_name(flag):
    name = next(iter(flag)).replace("_", "-")
    with pytest.raises(ValueError, match=f"--{name}"):
        ServerArgs(model_path="unused", enable_lora=True, max_lora_rank=8, lora_target_modules=["all"], **flag)

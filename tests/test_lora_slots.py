"""Issue 37's bookkeeping without a model: the LoRA flags and adapter configs (radixrt/settings/lora.py),
and the scheduler's registry and slots (scheduler/lora_slots.py): SGLang's refusals, the
--max-loaded-loras unload of the least recently used adapter, the slot eviction policies, pinned
adapters, and the per-step cap that makes adapters wait their turn without starving."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from radixrt.config import ServerArgs
from radixrt.settings.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterConfig,
    AdapterError,
    LoraRef,
    LoraServing,
    parse_lora_paths,
    read_adapter,
    split_model_name,
    target_sites,
)
from radixrt.messages import LoadLoraAdapter, LoraLoaded
from radixrt.namespace import CacheNamespace
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.lora_requests import LoraRequests
from radixrt.scheduler.lora_slots import LoraSlots, NoLoraSlots, namespace_key
from radixrt.scheduler.req import Req

ALL = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def test_lora_paths_take_sglangs_three_forms():
    refs = parse_lora_paths(["a=/x/a", "/x/b", '{"lora_name": "c", "lora_path": "/x/c", "pinned": true}'])
    assert refs == [LoraRef("a", "/x/a"), LoraRef("/x/b", "/x/b"), LoraRef("c", "/x/c", True)]
    with pytest.raises(ValueError, match="twice"):
        parse_lora_paths(["a=/x", "a=/y"])


def test_target_modules_and_the_openai_model_name():
    assert target_sites(["q_proj", "v_proj", "down_proj"]) == ("qkv_proj", "down_proj")
    assert target_sites(["all"]) == ALL and target_sites(None) is None
    with pytest.raises(ValueError, match="lm_head"):
        target_sites(["lm_head"])
    assert split_model_name("base:a1") == ("base", "a1") and split_model_name("base") == ("base", None)
    assert split_model_name(" base : a1 ") == ("base", "a1") and split_model_name("base:") == ("base", None)


@pytest.mark.parametrize("flags, message", [
    (dict(lora_target_modules=["all", "q_proj"], max_lora_rank=8), "should be the only module"),
    (dict(max_lora_rank=8), "you need to specify both"),
    (dict(lora_target_modules=["all"]), "you need to specify both"),
    (dict(max_lora_rank=8, lora_target_modules=["all"], max_loaded_loras=2, max_loras_per_batch=4), "greater than"),
    (dict(max_lora_rank=8, lora_target_modules=["all"], max_loras_per_batch=0), "must be positive"),
    (dict(max_lora_rank=8, lora_target_modules=["all"], lora_eviction_policy="lfu"), "lru"),
    (dict(max_lora_rank=8, lora_target_modules=["all"], speculative_algorithm="NGRAM"), "--speculative-algorithm"),
])
def test_flags_are_checked_as_sglang_checks_them(flags, message):
    with pytest.raises(ValueError, match=message):
        ServerArgs(model_path="unused", enable_lora=True, **flags)


def test_lora_paths_turn_lora_on_and_decode_runs_eagerly(tmp_path):
    path = write_adapter(tmp_path / "a", r=4)
    args = ServerArgs(model_path="unused", lora_paths=[f"a={path}"])
    assert args.enable_lora and args.disable_cuda_graph
    serving = args.lora
    assert serving.rank == 4 and serving.sites == ("qkv_proj", "o_proj") and serving.slots == 8
    assert serving.adapters[0].scaling == 16 / 4 and serving.max_loaded is None


def write_adapter(folder, r=8, targets=("q_proj", "v_proj", "o_proj"), extra_keys=(), **config):
    """A PEFT-format adapter by hand (the layout peft writes), on a 16-wide model."""
    folder.mkdir(parents=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 16, "target_modules": list(targets), "bias": "none", **config}
    (folder / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    tensors = {}
    for module in [f"model.layers.0.self_attn.{t}" for t in targets] + list(extra_keys):
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.ones(r, 16)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.ones(16, r)
    save_file(tensors, folder / ADAPTER_WEIGHTS)
    return folder


@pytest.mark.parametrize("setup, message", [
    (dict(r=16), "rank 16 is larger than --max-lora-rank 8"),
    (dict(targets=("q_proj", "gate_proj")), "gate_up_proj"),
    (dict(targets=("lm_head",)), "lm_head"),
    (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
    (dict(use_dora=True), "DoRA"),
    (dict(extra_keys=("model.layers.0.mlp.experts.0.gate_proj",)), "MoE experts"),
])
def test_adapter_errors_name_the_adapter(tmp_path, setup, message):
    path = write_adapter(tmp_path / "bad", **setup)
    with pytest.raises(AdapterError, match=message) as e:
        read_adapter(LoraRef("mine", str(path)), max_rank=8, sites=("qkv_proj", "o_proj"))
    assert "'mine'" in str(e.value)
    with pytest.raises(AdapterError, match="'gone'.*no PEFT checkpoint"):
        read_adapter(LoraRef("gone", str(tmp_path / "nothing")))


def test_the_fingerprint_follows_the_bytes(tmp_path):
    a = read_adapter(LoraRef("x", str(write_adapter(tmp_path / "a"))))
    assert read_adapter(LoraRef("x", str(write_adapter(tmp_path / "b")))).fingerprint == a.fingerprint
    c = read_adapter(LoraRef("x", str(write_adapter(tmp_path / "c", r=4))))
    assert c.fingerprint != a.fingerprint


# -- the scheduler's registry and slots ------------------------------------------------------

def adapter(name: str) -> AdapterConfig:
    return AdapterConfig(name, f"/x/{name}", 8, 2.0, ALL, f"fp-{name}")


def slots_of(n_slots: int, max_loaded: int | None = None, policy: str = "lru", start=()) -> LoraSlots:
    return LoraSlots(LoraServing(tuple(adapter(n) for n in start), (), 8, ALL, n_slots, max_loaded, policy))


def register(s: LoraSlots, name: str, pinned: bool = False):
    return s.register(LoadLoraAdapter("q", adapter(name), pinned))


def req(name: str | None, rid: str = "r") -> Req:
    key = namespace_key(adapter(name)) if name else None
    return Req(rid, [1, 2, 3], SamplingParams(), namespace=CacheNamespace(adapter=key))


def admit(s: LoraSlots, r: Req, running: list[Req]) -> bool:
    """One scheduling attempt, with the loads it asked for made (as scheduler/step.py makes them)."""
    step = s.step(running)
    if s.admissible(r, step):
        r.lora_slot = s.acquire(r, step)
        running.append(r)
        return True
    for m in s.take_loads():
        s.loaded(LoraLoaded(m.slot))
    return False


def test_registry_refusals_are_sglangs_and_name_the_adapter():
    s = slots_of(3, start=("a",))
    reply, _ = register(s, "a")
    assert not reply.success and "a because it is already loaded" in reply.error_message
    assert register(s, "p1", pinned=True)[0].success and register(s, "p2", pinned=True)[0].success
    reply, _ = register(s, "p3", pinned=True)  # every slot but one pinned already
    assert not reply.success and "Failed to load LoRA adapter p3 as a pinned adapter" in reply.error_message
    reply, _ = s.unregister("q", "nope")
    assert not reply.success and "nope does not exist" in reply.error_message
    assert register(s, "b")[0].loaded_adapters == {n: f"/x/{n}" for n in ("a", "p1", "p2", "b")}


def test_past_max_loaded_loras_the_least_recently_used_unpinned_adapter_is_unloaded():
    s = slots_of(2, max_loaded=3, start=("a", "b"))
    assert register(s, "p", pinned=True)[0].success
    while not admit(s, req("a"), []):  # a runs: b is the least recently used
        pass
    reply, unloaded = register(s, "c")
    assert reply.success and [u.name for u in unloaded] == ["b"] and set(reply.loaded_adapters) == {"a", "p", "c"}
    s.pinned.add("a")
    s.pinned.add("c")
    reply, unloaded = register(s, "d")  # nothing unpinned to unload
    assert not reply.success and "all pinned" in reply.error_message and unloaded == []


def test_a_request_waits_for_its_adapters_load_and_the_slot_is_not_used_before():
    s = slots_of(2, start=("a",))
    r = req("a")
    step = s.step([])
    assert not s.admissible(r, step) and s.slot_of(r) is None  # asked for, not loaded
    assert not s.admissible(r, step) and len(s.loads) == 1  # asked once
    (load,) = s.take_loads()
    assert s.slot_of(r) is None
    s.loaded(LoraLoaded(load.slot))
    assert s.admissible(r, step) and s.acquire(r, step) == load.slot


def test_a_failed_load_empties_its_slot():
    s = slots_of(1, start=("a",))
    assert not s.admissible(req("a"), s.step([]))
    (load,) = s.take_loads()
    assert s.loaded(LoraLoaded(load.slot, "disk full")).name == "a" and s.slots[0].adapter is None


@pytest.mark.parametrize("policy, victim", [("lru", "b"), ("fifo", "a")])
def test_eviction_policy_picks_the_idle_slot(policy, victim):
    s = slots_of(2, policy=policy, start=("a", "b", "c"))
    running: list[Req] = []
    for name in ("a", "b", "a"):  # a loaded first, b last used... then a again
        r = req(name)
        while not admit(s, r, running):
            pass
        s.release(r.lora_slot)
        running.remove(r)
    while not admit(s, req("c"), running):
        pass
    held = {sl.adapter.name for sl in s.slots}
    assert held == {"a", "b", "c"} - {victim}


def test_pinned_and_running_adapters_keep_their_slots():
    s = slots_of(2, start=("a", "b", "c"))
    register(s, "p", pinned=True)
    running: list[Req] = []
    while not admit(s, req("p", "p1"), running):
        pass
    s.release(running.pop().lora_slot)  # p idle, but pinned
    while not admit(s, req("a", "a1"), running):
        pass  # a runs
    assert not admit(s, req("b"), running) and not s.loads  # no slot to give: it waits
    assert {sl.adapter.name for sl in s.slots} == {"p", "a"}


def test_the_per_step_cap_makes_later_adapters_wait_but_never_the_base_model():
    s = slots_of(2, start=("a", "b", "c"))
    running: list[Req] = []
    for name in ("a", "b"):
        while not admit(s, req(name), running):
            pass
    step = s.step(running)
    assert not s.admissible(req("c"), step) and step.capped
    assert not s.admissible(req("a", "a2"), step)  # a runs, but c waits first: the running ones drain
    assert s.admissible(req(None), step)


def test_an_unloaded_adapters_slot_frees_when_its_last_request_leaves():
    s = slots_of(2, start=("a",))
    running: list[Req] = []
    r = req("a")
    while not admit(s, r, running):
        pass
    _, gone = s.unregister("q", "a")
    assert gone.name == "a" and s.slots[r.lora_slot].adapter is not None  # still running
    assert s.release(r.lora_slot) == namespace_key(gone) and s.slots[r.lora_slot].adapter is None


def test_figures_count_the_base_model_and_at_most_16_adapter_labels():
    counts = LoraRequests(NoLoraSlots(), None, None, None)
    for name in [None] + [f"x{i}" for i in range(20)]:
        r = req(name)
        r.kv.kv_len = 1  # its cached prefix
        counts.count_admission(r)
    figures = counts.stats()
    assert figures["lora_requests"]["base"] == 1 and figures["lora_prompt_tokens"]["x0"] == 3
    assert len(figures["lora_requests"]) == 17 and figures["lora_requests"]["other"] == 5  # 16 names, then "other"
    assert figures["lora_cached_tokens"]["x0"] == 1 and figures["lora_adapters"] == 0

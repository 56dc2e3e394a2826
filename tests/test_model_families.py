"""Every model family beyond llama/qwen2 gives transformers' greedy tokens through the Engine.

One tiny checkpoint per family (scripts/make_family_models.py): Qwen3, Qwen3-MoE, Mixtral,
Gemma 2, Gemma 3, Phi-3 (longrope), Mistral with a sliding window, Qwen2 with YaRN. For each,
at page size 1 or 16 (half the families each) with chunked prefill: eight prompts of 5 to 300 tokens (most longer
than the 32-token sliding windows; Phi-3's straddle its 64-token original context, one only
while decoding), then prompts that share a cached prefix, then the first four again beside
themselves under the family's random PEFT LoRA adapter (issue 37; attention only on the MoE
families, whose experts take no LoRA). Tensor parallelism on one MoE family and on Gemma 2.
References are transformers' own `generate` in float32 (peft's merged model for the adapter).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import msgspec
import pytest
import radixrt
import torch
from support.fake_worker import FakeWorker, reference_next
from support.helpers import assert_no_page_leak, corpus_prompts, hf_model
from support.lora_adapters import ensure_adapter, merged_model
from make_family_models import FAMILY_NAMES, LONGROPE_ORIGINAL, ensure_family_model
from radixrt.config import ServerArgs
from radixrt.config_views import SchedulerConfig
from radixrt.messages import TokenizedRequest
from radixrt.namespace import CacheNamespace
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.req import longrope_namespace
from radixrt.scheduler.scheduler import Scheduler
from radixrt.scheduler.step import drive

# 58: a Phi-3 prompt that is short (<= 64) but whose decoding crosses 64; 64: exactly the limit
LENGTHS = [5, 20, 33, 58, 64, 65, 150, 300]
PROMPT_SEED = 5
MAX_NEW = 8
# A reference token that wins by less than this would make the test measure float ties
# (batching changes fp32 reduction order by ~1e-5 in a logit), not the engine.
MIN_TOP2_GAP = 1e-3
LORA_PROMPTS = 4  # prompts run again under the family's LoRA adapter (issue 37)
CONFIGS = {"page1": dict(page_size=1, chunked_prefill_size=64), "page16": dict(page_size=16, chunked_prefill_size=64)}
GREEDY = {"max_new_tokens": MAX_NEW, "temperature": 0}
TP_FAMILIES = ["qwen3_moe", "gemma2"]  # run at page 16 below
# One engine per family (the suite's budget): half the families at each page size. The sliding
# window meets both (Mistral and Gemma 2 at page 1, Gemma 3 and Gemma 2 under tp at page 16),
# and the tensor-parallel families are the ones here at page 1.
PAGE1_FAMILIES = {"qwen3_moe", "gemma2", "phi3", "mistral"}


@dataclass(frozen=True)
class Greedy:
    tokens: list[int]
    logprobs: list[float]  # of each token, as transformers computed it (a monotone change such as
    # Gemma 2's final soft-capping or its attention scale may leave the tokens alone, not these)


def hf_greedy_checked(path, ids: list[int], model=None) -> Greedy:
    """transformers' greedy tokens for ids and their logprobs (of the checkpoint at path, or of
    `model`, its LoRA-merged copy), after checking no step was a near-tie."""
    with torch.no_grad():
        out = (model or hf_model(path)).generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), max_new_tokens=MAX_NEW,
            do_sample=False, top_k=None, top_p=None, temperature=None, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    tokens = out.sequences[0, len(ids) :].tolist()
    logprobs = []
    for step, (logits, token) in enumerate(zip(out.logits, tokens)):  # [1, vocab] per step, as generate computed them
        top2 = logits[0].float().topk(2).values
        gap = float(top2[0] - top2[1])
        assert gap >= MIN_TOP2_GAP, f"{path.name}: near-tie ({gap:.1e}) at step {step} of a {len(ids)}-token prompt"
        logprobs.append(float(torch.log_softmax(logits[0].float(), dim=-1)[token]))
    return Greedy(tokens, logprobs)


@functools.lru_cache(maxsize=None)
def family_path(name: str):
    return ensure_family_model(name)


def cache_prompts(path) -> dict[str, list[int]]:
    """A base prompt, then prompts that share its first 40 tokens (one short, one past Phi-3's 64),
    then one sharing the long one's first 100 tokens."""
    base, other = corpus_prompts(path, [48, 200], seed=PROMPT_SEED + 1)
    short, long = base[:40] + other[:16], base[:40] + other[:80]
    return {"base": base, "short": short, "long": long, "long2": long[:100] + other[100:140]}


@dataclass(frozen=True)
class References:
    prompts: list[list[int]]
    expected: list[Greedy]
    cache_prompts: dict[str, list[int]]  # the cache phase's, by role
    cache_expected: dict[str, Greedy]
    lora_expected: list[Greedy]  # of the first LORA_PROMPTS prompts, with the family's adapter merged


@functools.lru_cache(maxsize=None)
def references(name: str) -> References:
    """transformers' answers for the family's prompts, computed once."""
    path = family_path(name)
    prompts = corpus_prompts(path, LENGTHS, seed=PROMPT_SEED)
    cached = cache_prompts(path)
    merged = merged_model(path, family_adapter(name))
    return References(prompts, [hf_greedy_checked(path, p) for p in prompts], cached,
                      {k: hf_greedy_checked(path, p) for k, p in cached.items()},
                      [hf_greedy_checked(path, p, merged) for p in prompts[:LORA_PROMPTS]])  # fmt: skip


def family_adapter(name: str):
    """A random PEFT adapter of the family (attention and dense MLP; attention only on MoE models)."""
    return ensure_adapter(family_path(name), "fam", seed=11)


def generate(engine, prompts):
    return engine.generate(input_ids=prompts, sampling_params=GREEDY, return_logprob=True)


def assert_matches(result, want: Greedy, what: str) -> None:
    assert result["output_ids"] == want.tokens, what
    got = [lp for lp, _, _ in result["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(want.logprobs, abs=1e-4), what


def _check_batch(engine, name: str) -> None:
    ref = references(name)
    for ids, want, got in zip(ref.prompts, ref.expected, generate(engine, ref.prompts)):
        assert_matches(got, want, f"{name}: prompt of {len(ids)} tokens")


def _check_lora(engine, name: str) -> None:
    """The family's adapter beside the base model in one batch: the merged references, and a
    change from the base model's answer."""
    ref = references(name)
    prompts = ref.prompts[:LORA_PROMPTS]
    got = engine.generate(input_ids=prompts * 2, sampling_params=GREEDY, return_logprob=True,
                          lora_path=[None] * len(prompts) + ["fam"] * len(prompts))
    for i, (ids, want, res) in enumerate(zip(prompts * 2, ref.expected[:LORA_PROMPTS] + ref.lora_expected, got)):
        assert_matches(res, want, f"{name}: prompt of {len(ids)} tokens, {'base' if i < len(prompts) else 'adapter'}")
    # (Gemma's scaled embeddings can keep every greedy token: its logprobs still move)
    assert any(a.tokens != b.tokens or max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) > 1e-2
               for a, b in zip(ref.expected, ref.lora_expected)), f"{name}: the adapter changed nothing"


def _check_cache_hits(engine, name: str) -> None:
    """Shared prefixes come from the cache and change nothing; for Phi-3, a prompt past the
    original context never reads KV a short prompt computed under the short rope factors."""
    ref = references(name)
    prompts = ref.cache_prompts
    got = {"base": generate(engine, prompts["base"])}
    got["short"], got["long"] = generate(engine, [prompts["short"], prompts["long"]])
    got["long2"] = generate(engine, prompts["long2"])
    for key, res in got.items():
        assert_matches(res, ref.cache_expected[key], f"{name}: {key} prompt ({len(prompts[key])} tokens)")
    cached = {k: r["meta_info"]["cached_tokens"] for k, r in got.items()}
    assert cached["short"] > 0 and cached["long2"] > 0, cached
    if name == "phi3":  # the long prompt's namespace is not the base's
        assert len(prompts["long"]) > LONGROPE_ORIGINAL >= len(prompts["base"])
        assert cached["long"] == 0, cached
    else:
        assert cached["long"] > 0, cached


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_greedy_tokens_match_transformers(name):
    references(name)  # computed before the engine starts: the two would share the cores
    config = CONFIGS["page1" if name in PAGE1_FAMILIES else "page16"]
    with radixrt.Engine(model_path=str(family_path(name)), max_total_tokens=8192,
                        lora_paths=[f"fam={family_adapter(name)}"], **config) as engine:
        _check_batch(engine, name)
        _check_cache_hits(engine, name)
        _check_lora(engine, name)
        assert_no_page_leak(engine)


@pytest.mark.parametrize("name", TP_FAMILIES)
def test_tp2_matches_transformers(name):
    references(name)
    with radixrt.Engine(model_path=str(family_path(name)), tp_size=2, max_total_tokens=8192, **CONFIGS["page16"]) as engine:
        _check_batch(engine, name)
        assert_no_page_leak(engine)


class LongRopeWorker(FakeWorker):
    """A fake worker whose KV written under the long rope factors differs from the short one
    (each token is stored shifted by LONG), so reading the other kind's KV changes the tokens."""

    LONG = 7

    def __init__(self, threshold: int, num_pages: int, page_size: int) -> None:
        super().__init__(num_pages, page_size)
        self.ready.long_prompt_threshold = threshold
        self.long: dict[int, bool] = {}  # slot -> its request runs under the long factors

    def forward(self, batch):
        for e in batch.entries:
            if e.init is not None:
                self.long[e.slot] = e.init.long_rope
        entries = [msgspec.structs.replace(e, input_ids=[t + self.LONG * self.long[e.slot] for t in e.input_ids])
                   for e in batch.entries]  # fmt: skip
        return super().forward(msgspec.structs.replace(batch, entries=entries))


def longrope_reference(prompt: list[int], n: int, threshold: int) -> list[int]:
    """transformers' Phi-3 generate on the fake model: each next token from the whole sequence,
    computed under the long factors iff the sequence is longer than the threshold."""
    seq = list(prompt)
    for _ in range(n):
        shift = LongRopeWorker.LONG * (len(seq) > threshold)
        seq.append(reference_next([t + shift for t in seq]))
    return seq[len(prompt) :]


def test_longrope_requests_recompute_when_they_cross_and_never_share_kv_across_factors():
    threshold, page_size = 12, 4
    worker = LongRopeWorker(threshold, num_pages=64, page_size=page_size)
    scheduler = Scheduler(SchedulerConfig.of(ServerArgs(model_path="unused", page_size=page_size, schedule_policy="fcfs")),
                          worker.ready, None)
    base = list(range(1, 9))  # 8 tokens: short; it crosses the threshold while decoding
    reqs = {  # rid -> (prompt, new tokens, salt)
        "cross": (base, 10, None),
        "short": (base + [20], 2, None),  # shares base's short KV
        "long": (base + list(range(20, 28)), 3, None),  # 16 tokens: long from the start
        "long2": (base + list(range(20, 28)) + [30, 31], 2, None),  # shares long's KV
        "salted": (base + [20], 2, "L"),  # a user salt spelled like the long namespace shares nothing
    }
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    for rid, (prompt, n, salt) in reqs.items():  # one at a time: what each finds cached is fixed
        sampling = SamplingParams(max_new_tokens=n, ignore_eos=True, temperature=0)
        scheduler.add_request(TokenizedRequest(rid, prompt, sampling, namespace=CacheNamespace(salt=salt)))
        for out in drive(scheduler, worker):
            outputs[out.rid] = outputs.get(out.rid, []) + out.new_ids
            cached[out.rid] = out.cached_tokens
        assert outputs[rid] == longrope_reference(prompt, n, threshold), rid
    assert scheduler.stats().recomputed_tokens > 0  # "cross" ran its sequence again under the long factors
    # "short" reads the short KV "cross" left when it crossed, "long" the long KV of its recompute
    assert (cached["short"], cached["long"], cached["long2"], cached["salted"]) == (8, 8, 16, 0), cached
    assert scheduler.mem.allocator.num_free + scheduler.mem.cache.total_pages == 64


def test_longrope_namespaces_are_distinct_for_every_salt():
    salts = [None, "", "L", "S+", "L+", "x", "+x"]
    keys = [longrope_namespace(CacheNamespace(salt=s), long) for s in salts for long in (False, True)]
    assert len(set(keys)) == len(keys) and len({k.encoded for k in keys}) == len(keys)
    assert longrope_namespace(CacheNamespace(), False) == CacheNamespace()  # short unsalted prompts: the default cache

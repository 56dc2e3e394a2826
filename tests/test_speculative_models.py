"""Speculative decoding on real models, in process (a Scheduler over a ModelRunner): greedy
outputs token for token equal to plain decoding in fp32 (NGRAM at page sizes 1 and 16 with
chunked prefill; STANDALONE with a draft made of the target's first layers, which must be
accepted more often than not), seeded sampling identical to plain decoding, and unseeded
sampling that keeps the target's distribution (a chi-square test on a tiny-vocabulary model)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from support.draft_models import first_layers_draft
from support.helpers import tokenizer

from radixrt.config import ServerArgs
from radixrt.config_views import SchedulerConfig
from radixrt.messages import TokenizedRequest
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.scheduler import Scheduler
from radixrt.scheduler.step import drive
from radixrt.worker.model_runner import ModelRunner

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
WORLD = ROOT / "assets" / "world-llama"  # trained: its first layers draft well


def generate(model: Path, prompts: list[list[int]], sampling: list[dict], **args) -> tuple[list[list[int]], Scheduler]:
    """Each prompt's output under its sampling params, and the scheduler (its stats, its pool)."""
    server = ServerArgs(model_path=str(model), device="cpu", dtype="float32", max_total_tokens=8192, **args)
    runner = ModelRunner(server)
    s = Scheduler(SchedulerConfig.of(server), runner.ready_message(), tokenizer(model))
    for i, (p, sp) in enumerate(zip(prompts, sampling)):
        s.add_request(TokenizedRequest(f"r{i}", p, SamplingParams(**sp)))
    out: dict[str, list[int]] = {}
    for o in drive(s, runner):
        out.setdefault(o.rid, []).extend(o.new_ids)
    assert s.mem.allocator.num_free + s.mem.cache.total_pages == s.mem.allocator.num_pages  # no page leaked
    return [out[f"r{i}"] for i in range(len(prompts))], s


def greedy(n: int, **extra) -> dict:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True, **extra}


WORLD_TEXTS = ["Where does Mara Quill live?", "R1: A=12.5 B=80.3 C=44.1\nR2: A=9.6 B=31.0 C=77.7\nR1:",
               "The capital of Estmoor is"]


def spy_trees(monkeypatch) -> Counter:
    """Counts the worker's draft trees ("trees") and kept branches whose KV moved ("moves")."""
    from radixrt.worker import model_runner

    seen: Counter = Counter()
    masks, copies = model_runner.tree_masks, model_runner.branch_copies

    def tree_masks(entries, device):
        out = masks(entries, device)
        seen["trees"] += len(out)
        return out

    def branch_copies(entries, paths):
        out = copies(entries, paths)
        seen["moves"] += len(out[0])
        return out

    monkeypatch.setattr(model_runner, "tree_masks", tree_masks)
    monkeypatch.setattr(model_runner, "branch_copies", branch_copies)
    return seen


@pytest.mark.parametrize("page_size, match", [(1, "BFS"), (16, "PROB")])
def test_ngram_greedy_equals_plain_decoding(page_size, match, monkeypatch):
    """The world model's tables and lists repeat, so the request's own text drafts; chunked prefill
    of 8. Chains, then trees, whose kept branches' KV must move to verify exactly."""
    tok = tokenizer(WORLD)
    prompts = [tok(t)["input_ids"] for t in WORLD_TEXTS]
    args = {"page_size": page_size, "chunked_prefill_size": 8}
    want, _ = generate(WORLD, prompts, [greedy(40)] * 3, **args)
    spec = {"speculative_algorithm": "NGRAM", "speculative_draft_policy": "max"}
    got, s = generate(WORLD, prompts, [greedy(40)] * 3, **spec, **args)
    assert got == want
    st = s.stats()
    assert st.spec_draft_tokens > 0 and st.spec_accepted_tokens > 0
    seen = spy_trees(monkeypatch)
    got, s = generate(WORLD, prompts, [greedy(40)] * 3, **spec, **args, speculative_ngram_max_bfs_breadth=4,
                      speculative_ngram_match_type=match)
    assert got == want
    assert seen["trees"] > 10 and seen["moves"] > 0, seen


def test_standalone_with_a_first_layers_draft_equals_plain_decoding(tmp_path):
    draft = first_layers_draft(WORLD, 3, tmp_path / "draft")
    tok = tokenizer(WORLD)
    prompts = [tok(t)["input_ids"] for t in WORLD_TEXTS]
    want, _ = generate(WORLD, prompts, [greedy(40)] * 3, page_size=4)
    got, s = generate(WORLD, prompts, [greedy(40)] * 3, page_size=4, speculative_algorithm="STANDALONE",
                      speculative_draft_model_path=str(draft), speculative_num_steps=2, speculative_draft_policy="max")
    assert got == want
    st = s.stats()
    assert st.spec_draft_tokens >= 30 and st.spec_accept_rate > 0.5, (st.spec_draft_tokens, st.spec_accept_rate)


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory) -> Path:
    """A random llama over 6 tokens, with logits spread enough that every token has mass."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("vocab6")
    torch.manual_seed(3)
    cfg = LlamaConfig(vocab_size=6, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=5,
                      tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    vocab = {chr(97 + i): i for i in range(6)}
    (path / "tokenizer.json").write_text(json.dumps({
        "version": "1.0", "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "a"},
        "pre_tokenizer": {"type": "Whitespace"}, "added_tokens": [], "normalizer": None, "post_processor": None,
        "decoder": None, "truncation": None, "padding": None}))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def sampled(n: int, seed: int | None = None) -> dict:
    return {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True, "seed": seed}


@pytest.mark.parametrize("breadth", [1, 3])
def test_seeded_sampling_draws_the_same_tokens_with_speculation(tiny_vocab_model, breadth, monkeypatch):
    """A seeded draw depends on (seed, output position) only, and each verify row draws as its
    position would (a tree's siblings alike): drafts change which forward computes a token, never the token."""
    prompts = [[1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]] * 64
    sp = [sampled(12, seed) for seed in range(64)]
    want, _ = generate(tiny_vocab_model, prompts, sp)
    seen = spy_trees(monkeypatch)
    got, s = generate(tiny_vocab_model, prompts, sp, speculative_algorithm="NGRAM", speculative_draft_policy="max",
                      speculative_ngram_min_bfs_breadth=breadth,
                      speculative_ngram_max_bfs_breadth=breadth)
    assert got == want
    assert s.stats().spec_accepted_tokens > 0
    assert (seen["trees"] > 0) == (breadth > 1), seen


N_DRAWS = 2000
REPEATS = [1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2]


@pytest.fixture(scope="module")
def plain_draws(tiny_vocab_model) -> list[list[int]]:
    """4 tokens drawn per request without speculation (the second's verify step may then hold 2 drafts: a tree)."""
    return generate(tiny_vocab_model, [REPEATS] * N_DRAWS, [sampled(4)] * N_DRAWS, random_seed=1)[0]


@pytest.mark.parametrize("breadth", [1, 3])
def test_unseeded_sampling_keeps_the_target_distribution(tiny_vocab_model, plain_draws, breadth, monkeypatch):
    """The joint law of the first 3 sampled tokens (216 outcomes, pooled into the frequent ones),
    with and without speculation: a chi-square test of homogeneity. Drafts from the request's own
    repetitive prompt are accepted often and rejected often, so both paths of acceptance count;
    with breadth 3 they come as trees (from the outputs of requests that finished)."""
    n, plain = N_DRAWS, plain_draws
    seen = spy_trees(monkeypatch)
    spec, s = generate(tiny_vocab_model, [REPEATS] * n, [sampled(4)] * n, random_seed=2, speculative_algorithm="NGRAM",
                       speculative_draft_policy="max", speculative_ngram_min_bfs_breadth=breadth,
                       speculative_ngram_max_bfs_breadth=breadth)
    assert (seen["moves"] > 0) == (breadth > 1), seen
    st = s.stats()
    assert st.spec_accepted_tokens > n // 10 and st.spec_draft_tokens - st.spec_accepted_tokens > n // 10, st
    a, b = (Counter(tuple(out[:3]) for out in outs) for outs in (plain, spec))
    common = [k for k in set(a) | set(b) if a[k] + b[k] >= 20]
    rest = [sum(a[k] for k in a if k not in common), sum(b[k] for k in b if k not in common)]
    table = [[a[k] for k in common] + [rest[0]], [b[k] for k in common] + [rest[1]]]
    p = homogeneity_p_value(table)
    assert p > 1e-3, p


def homogeneity_p_value(table: list[list[int]]) -> float:
    """Pearson's chi-square test that the rows of a contingency table share one distribution."""
    t = torch.tensor(table, dtype=torch.float64)  # [rows, cols]
    expected = t.sum(1, keepdim=True) * t.sum(0, keepdim=True) / t.sum()
    stat = ((t - expected) ** 2 / expected).sum()
    dof = (t.shape[0] - 1) * (t.shape[1] - 1)
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))

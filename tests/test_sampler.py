"""The sampler held to naive per-token references: greedy, filters, seeds, penalties, bans."""

from __future__ import annotations

import math
import random

import msgspec
import pytest
import torch

from radixrt.sampling_params import SamplingParams
from radixrt.worker.sampler import Sampler, apply_penalties

CPU = torch.device("cpu")


def greedy(**kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)  # type: ignore[arg-type]


def sample_steps(sampler: Sampler, logits: torch.Tensor, slots: list[int], steps: int) -> list[list[int]]:
    """The same logits every step -> per step, the ids drawn for `slots`."""
    return [sampler.sample(logits, slots).tolist() for _ in range(steps)]


# -- naive references -----------------------------------------------------------


def reference_probs(logits: list[float], p: SamplingParams) -> list[float]:
    """Temperature, then top_k, top_p of what top_k kept, min_p; renormalized. float64, per token."""
    scaled = [x / p.temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    probs = [w / sum(weights) for w in weights]
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = order if p.top_k == -1 else order[: p.top_k]
    mass, nucleus, before = sum(probs[i] for i in kept), [], 0.0
    for i in kept:
        if before >= p.top_p * mass:
            break
        nucleus.append(i)
        before += probs[i]
    final = [i for i in nucleus if probs[i] >= p.min_p * probs[order[0]]]
    z = sum(probs[i] for i in final)
    return [probs[i] / z if i in final else 0.0 for i in range(len(probs))]


def reference_penalized(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    out = []
    for tok, x in enumerate(logits):
        count = output.count(tok)
        if tok in prompt or count:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        out.append(x - p.frequency_penalty * count - p.presence_penalty * (count > 0))
    return out


# -- greedy ---------------------------------------------------------------------


def test_greedy_rows_equal_argmax() -> None:
    torch.manual_seed(0)
    sampler = Sampler(8, 100, CPU)
    params = [greedy(), SamplingParams(top_k=1), SamplingParams(top_k=1, temperature=2.0), greedy(seed=3)]
    for slot, p in enumerate(params):
        sampler.add(slot, p, [], [])
    for _ in range(5):
        logits = torch.randn(4, 100) * 3
        assert torch.equal(sampler.sample(logits, [3, 1, 0, 2]), logits.argmax(dim=-1))


def test_greedy_rows_in_a_mixed_batch_equal_argmax() -> None:
    torch.manual_seed(1)
    sampler = Sampler(6, 50, CPU)
    kinds = [greedy(), SamplingParams(top_p=0.9), SamplingParams(top_k=1), SamplingParams(seed=5, min_p=0.1)]
    for slot, p in enumerate(kinds):
        sampler.add(slot, p, [], [])
    for _ in range(5):
        logits = torch.randn(4, 50) * 3
        ids = sampler.sample(logits, [0, 1, 2, 3])
        assert ids.dtype == torch.int64 and ids.shape == (4,)
        assert ids[0] == logits[0].argmax() and ids[2] == logits[2].argmax()


def test_sample_leaves_input_logits_untouched() -> None:
    sampler = Sampler(2, 10, CPU)
    sampler.add(0, SamplingParams(frequency_penalty=1.0, min_new_tokens=3, top_k=3), [], [4])
    logits = torch.randn(1, 10)
    before = logits.clone()
    sample_steps(sampler, logits, [0], 3)
    assert torch.equal(logits, before)


# -- seeds ----------------------------------------------------------------------

SEEDED_TARGETS = [
    SamplingParams(seed=1234),
    SamplingParams(seed=-7, temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, frequency_penalty=0.3),
]


def run_alone(target: SamplingParams, logits: torch.Tensor) -> list[int]:
    sampler = Sampler(1, logits.shape[1], CPU)
    sampler.add(0, target, [1, 2], [])
    return [sampler.sample(row[None], [0]).item() for row in logits]


def run_in_batch(target: SamplingParams, logits: torch.Tensor, target_slot: int, shuffle: int) -> list[int]:
    """`target` on `target_slot` among seeded, unseeded, greedy and penalized neighbours, rows shuffled."""
    steps, vocab = logits.shape
    sampler = Sampler(16, vocab, CPU)
    others = {
        0: SamplingParams(seed=1234 + 1, top_k=5),
        3: SamplingParams(top_p=0.7),
        5: greedy(),
        12: SamplingParams(min_p=0.1, repetition_penalty=1.5, presence_penalty=0.5),
        14: SamplingParams(seed=target.seed, temperature=1.5),  # same seed, other params
    }
    for slot, p in others.items():
        sampler.add(slot, p, [0, 1, 2], [])
    sampler.add(target_slot, target, [1, 2], [])
    rng = random.Random(shuffle)
    out = []
    for t in range(steps):
        slots = [target_slot, *others]
        rng.shuffle(slots)
        batch = torch.randn(len(slots), vocab)
        batch[slots.index(target_slot)] = logits[t]
        out.append(sampler.sample(batch, slots)[slots.index(target_slot)].item())
    return out


@pytest.mark.parametrize("target", SEEDED_TARGETS)
def test_seeded_request_is_reproducible_alone_and_in_any_batch(target: SamplingParams) -> None:
    torch.manual_seed(2)
    logits = torch.randn(20, 64) * 0.5  # flat enough that the draw matters
    alone = run_alone(target, logits)
    torch.manual_seed(99)  # the global RNG must not matter either
    assert run_alone(target, logits) == alone
    for target_slot, shuffle in [(9, 0), (1, 1), (15, 2)]:
        assert run_in_batch(target, logits, target_slot, shuffle) == alone
    assert run_alone(msgspec.structs.replace(target, seed=4321), logits) != alone


# -- filters and the drawn distribution ------------------------------------------

DISTRIBUTION_CASES = [
    SamplingParams(),
    SamplingParams(temperature=0.6),
    SamplingParams(top_k=5),
    SamplingParams(top_p=0.6),
    SamplingParams(min_p=0.2),
    SamplingParams(temperature=1.3, top_k=8, top_p=0.7, min_p=0.05),
    SamplingParams(seed=0),  # each slot gets seed = slot below: the seeded draw path
]


def describe(p: SamplingParams) -> str:
    """A test id: the fields that differ from the defaults."""
    default = SamplingParams()
    return ",".join(f"{f}={getattr(p, f)}" for f in p.__struct_fields__ if getattr(p, f) != getattr(default, f)) or "default"


@pytest.mark.parametrize("params", DISTRIBUTION_CASES, ids=describe)
def test_drawn_frequencies_match_reference(params: SamplingParams) -> None:
    torch.manual_seed(3)
    vocab, rows, steps = 24, 200, 100  # many steps per slot: a seeded slot's draws must vary by position
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(4)) * 1.5
    sampler = Sampler(rows, vocab, CPU)
    for slot in range(rows):
        p = params if params.seed is None else SamplingParams(seed=slot)
        sampler.add(slot, p, [], [])
    ids = torch.cat([sampler.sample(logits.expand(rows, vocab), list(range(rows))) for _ in range(steps)])
    expected = reference_probs(logits.tolist(), params)
    freq = torch.bincount(ids, minlength=vocab).double() / len(ids)
    assert all(expected[i] > 0 for i in ids.unique().tolist()), "drew an id the filters exclude"
    assert (freq - torch.tensor(expected, dtype=torch.float64)).abs().max() < 0.015


@pytest.mark.parametrize(
    "params",
    [SamplingParams(top_k=7), SamplingParams(top_p=0.5), SamplingParams(min_p=0.3), SamplingParams(top_k=50, top_p=0.3)],
    ids=describe,
)
def test_large_vocab_draws_stay_inside_the_filtered_set(params: SamplingParams) -> None:
    torch.manual_seed(5)
    vocab, rows = 1000, 32
    logits = torch.randn(rows, vocab) * 2
    sampler = Sampler(rows, vocab, CPU)
    for slot in range(rows):
        sampler.add(slot, params, [], [])
    allowed = [{i for i, q in enumerate(reference_probs(row, params)) if q > 0} for row in logits.tolist()]
    for _ in range(10):
        ids = sampler.sample(logits, list(range(rows))).tolist()
        assert all(tok in ok for tok, ok in zip(ids, allowed))


# -- penalties ------------------------------------------------------------------


def test_apply_penalties_matches_per_token_reference() -> None:
    torch.manual_seed(6)
    rows, vocab = 5, 40
    logits = torch.randn(rows, vocab) * 2
    logits[:, :3] = 0.0  # the logit == 0 edge
    counts = torch.randint(0, 4, (rows, vocab), dtype=torch.int32) * (torch.rand(rows, vocab) < 0.3)
    in_prompt = torch.rand(rows, vocab) < 0.2
    params = [
        SamplingParams(
            repetition_penalty=random.Random(r).uniform(0.5, 2.0),
            frequency_penalty=random.Random(r + 10).uniform(-2, 2),
            presence_penalty=random.Random(r + 20).uniform(-2, 2),
        )
        for r in range(rows)
    ]
    got = apply_penalties(
        logits,
        counts,
        in_prompt,
        torch.tensor([p.repetition_penalty for p in params]),
        torch.tensor([p.frequency_penalty for p in params]),
        torch.tensor([p.presence_penalty for p in params]),
    )
    for r, p in enumerate(params):
        prompt = in_prompt[r].nonzero().flatten().tolist()
        output = [tok for tok, c in enumerate(counts[r].tolist()) for _ in range(c)]
        expected = reference_penalized(logits[r].tolist(), prompt, output, p)
        assert torch.allclose(got[r], torch.tensor(expected), atol=1e-5)


def test_sampler_penalizes_with_its_own_history() -> None:
    """processed_logits follows prompt + sampled history; unpenalized rows pass through."""
    torch.manual_seed(7)
    vocab, prompt = 12, [3, 3, 7]
    p = greedy(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.6)
    sampler = Sampler(4, vocab, CPU)
    sampler.add(2, p, prompt, [])
    sampler.add(0, greedy(), [], [])
    assert sampler.counts is not None
    output: list[int] = []
    for _ in range(8):
        logits = torch.randn(2, vocab) * 0.5
        logits[:, 0] += 5.0  # id 0 wins again despite its penalties: repeats happen
        processed = sampler.processed_logits(logits, [0, 2])
        expected = reference_penalized(logits[1].tolist(), prompt, output, p)
        assert torch.equal(processed[0], logits[0])
        assert torch.allclose(processed[1], torch.tensor(expected), atol=1e-5)
        ids = sampler.sample(logits, [0, 2]).tolist()
        assert ids[1] == max(range(vocab), key=lambda i: expected[i])
        output.append(ids[1])
    assert len(set(output)) < len(output), "the logits should have produced a repeat"


@pytest.mark.parametrize(
    ("params", "prompt", "expected"),
    [
        # counts 1,0,0: (1.5, 1.9, 1.65); 1,1,0: (1.5, 1.4, 1.65); 1,1,1: (1.5, 1.4, 1.15)
        (greedy(frequency_penalty=0.5), [], [0, 1, 2, 0]),
        # presence does not grow: (1.7, 1.9, 1.65) -> (1.7, 1.6, 1.65) -> id 0 from then on
        (greedy(presence_penalty=0.3), [], [0, 1, 0, 0]),
        # id 0 in the prompt: 2.0 / 1.1 = 1.82 < 1.9; then 1.9 / 1.1 = 1.73 < 1.82, and it does not grow
        (greedy(repetition_penalty=1.1), [0], [1, 0, 0, 0]),
        (greedy(), [0], [0, 0, 0, 0]),
    ],
)
def test_penalties_flip_the_greedy_choice(params: SamplingParams, prompt: list[int], expected: list[int]) -> None:
    sampler = Sampler(1, 5, CPU)
    sampler.add(0, params, prompt, [])
    logits = torch.tensor([[2.0, 1.9, 1.65, 0.0, -1.0]])
    assert [step[0] for step in sample_steps(sampler, logits, [0], 4)] == expected


def test_penalty_state_is_lazy() -> None:
    sampler = Sampler(3, 10, CPU)
    sampler.add(0, SamplingParams(top_p=0.5), [1, 2], [3])
    sample_steps(sampler, torch.randn(1, 10), [0], 2)
    assert sampler.counts is None and sampler.in_prompt is None


# -- min_new_tokens ---------------------------------------------------------------


def test_min_new_tokens_bans_stop_ids_until_reached() -> None:
    sampler = Sampler(2, 10, CPU)
    sampler.add(1, greedy(min_new_tokens=3), [], [2, 5, 10_000])  # an id past the vocab is ignored
    sampler.add(0, greedy(), [], [2, 5])  # no minimum: stops at once
    logits = torch.tensor([[0.0, 1.0, 10.0, 0.0, 0.0, 9.0, 0.0, 0.0, 0.0, 0.0]]).repeat(2, 1)
    steps = sample_steps(sampler, logits, [0, 1], 5)
    assert [s[1] for s in steps] == [1, 1, 1, 2, 2]
    assert [s[0] for s in steps] == [2] * 5


def test_min_new_tokens_bans_stop_ids_in_drawn_rows() -> None:
    torch.manual_seed(8)
    rows, vocab = 300, 8
    sampler = Sampler(rows, vocab, CPU)
    for slot in range(rows):
        sampler.add(slot, SamplingParams(min_new_tokens=2, seed=slot if slot % 2 else None), [], [0, 4])
    logits = torch.zeros(rows, vocab)
    logits[:, [0, 4]] = 3.0  # stop ids hold ~85% of the mass
    steps = [set(ids) for ids in sample_steps(sampler, logits, list(range(rows)), 3)]
    assert not steps[0] & {0, 4} and not steps[1] & {0, 4}
    assert {0, 4} <= steps[2]


# -- slot reuse -------------------------------------------------------------------


def test_remove_then_add_starts_the_slot_fresh() -> None:
    torch.manual_seed(9)
    vocab = 16
    sampler = Sampler(2, vocab, CPU)
    logits = torch.randn(1, vocab) * 0.3
    first = SamplingParams(seed=11, frequency_penalty=2.0, repetition_penalty=1.5, min_new_tokens=4)
    sampler.add(1, first, [0, 1, 2], [3])
    first_ids = [s[0] for s in sample_steps(sampler, logits, [1], 6)]
    sampler.remove(1)
    sampler.add(1, greedy(presence_penalty=1.0), [], [])
    assert torch.equal(sampler.processed_logits(logits, [1]), logits), "leftover counts or prompt"
    sampler.remove(1)
    sampler.add(1, first, [0, 1, 2], [3])  # the same request again: same ids, bans active again
    assert [s[0] for s in sample_steps(sampler, logits, [1], 6)] == first_ids
    assert 3 not in first_ids[:4]


def test_bad_calls_raise() -> None:
    sampler = Sampler(2, 10, CPU)
    sampler.add(0, SamplingParams(), [], [])
    with pytest.raises(KeyError):
        sampler.sample(torch.randn(1, 10), [1])
    with pytest.raises(ValueError):
        sampler.sample(torch.randn(1, 11), [0])
    with pytest.raises(ValueError):
        sampler.add(1, SamplingParams(repetition_penalty=1.2), [10], [])
    with pytest.raises(ValueError):
        sampler.add(2, SamplingParams(), [], [])
    assert sampler.sample(torch.empty(0, 10), []).shape == (0,)


def test_add_with_previous_output_resumes_counts_position_and_bans():
    """A retracted request re-added with its output so far continues exactly where it was."""
    torch.manual_seed(0)
    v = 40
    params = SamplingParams(temperature=1.0, seed=7, frequency_penalty=0.5, min_new_tokens=6)
    logits = [torch.randn(1, v) for _ in range(10)]
    straight = Sampler(4, v, torch.device("cpu"))
    straight.add(0, params, [1, 2], [3])
    want = [int(straight.sample(lg, [0])) for lg in logits]
    resumed = Sampler(4, v, torch.device("cpu"))
    resumed.add(2, params, [1, 2], [3])
    got = [int(resumed.sample(lg, [2])) for lg in logits[:4]]
    resumed.remove(2)
    resumed.add(1, params, [1, 2], [3], output_ids=got)
    got += [int(resumed.sample(lg, [1])) for lg in logits[4:]]
    assert got == want


# -- one bad row -------------------------------------------------------------------


def test_sample_isolated_fails_only_the_bad_rows_and_records_the_good_ones_once() -> None:
    """Rows whose state breaks the batch (a stop id past the vocabulary, which add() never
    keeps; a slot with no request) fail alone, every step; the other rows get the ids they
    get without them, and their seeded positions and penalty counts advance once per step."""
    torch.manual_seed(3)
    vocab = 12
    good = {0: SamplingParams(seed=5, temperature=0.9), 2: greedy(frequency_penalty=1.5, min_new_tokens=2)}

    def sampler_with_good_rows() -> Sampler:
        s = Sampler(4, vocab, CPU)
        for slot, p in good.items():
            s.add(slot, p, [], [1])
        return s

    alone, mixed = sampler_with_good_rows(), sampler_with_good_rows()
    mixed.add(1, greedy(min_new_tokens=3), [], [1])
    mixed._slots[1].stop_ids = [vocab + 5]  # NOTE: corrupt on purpose: _ban_stops raises on it
    logits = torch.randn(4, vocab)
    logits[:, 3] += 2.0  # a greedy favourite that the frequency penalty takes away after one pick
    got, want = [], []
    for _ in range(4):
        res = mixed.sample_isolated(logits, [0, 1, 2, 3])  # slot 3: no request
        assert res.ids[1] is None and res.ids[3] is None and res.errors.keys() == {1, 3}
        assert "IndexError" in res.errors[1] and "KeyError" in res.errors[3]
        got.append([res.ids[0], res.ids[2]])
        want.append(alone.sample(logits[[0, 2]], [0, 2]).tolist())
    assert got == want
    assert len({ids[1] for ids in want}) > 1, "the penalty should have moved the greedy row"
    clean = sampler_with_good_rows().sample_isolated(logits[[0, 2]], [0, 2])
    assert clean.errors == {} and clean.ids == want[0]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_p=1e-320),  # 0 in float32
    SamplingParams(temperature=1.0, top_p=1e-40, top_k=5),
    SamplingParams(temperature=1.0, min_p=1.0),
    SamplingParams(temperature=1.0, repetition_penalty=1e-38),  # logit / 1e-38 overflows float32
    SamplingParams(temperature=0.0, repetition_penalty=1e-320),
    SamplingParams(temperature=1.0, repetition_penalty=1e-320, top_p=1e-320),
])
def test_degenerate_filters_and_penalties_keep_the_most_likely_token(params) -> None:
    """Whatever top_p, min_p or penalties are, the draw is the most likely token of the processed
    distribution, never token 0 from an all-zero or NaN row."""
    torch.manual_seed(11)
    vocab, prompt = 50, [7, 9, 30]
    logits = torch.randn(3, vocab)
    logits[:, 0] = -5.0  # token 0 is never the answer
    logits[:, 12] = 6.0  # the most likely token without penalties
    logits[:, 30] = 4.0  # with a repetition penalty near 0: the largest positive logit in the prompt
    logits[:, 9] = 3.0
    sampler = Sampler(3, vocab, CPU)
    for slot in range(3):
        sampler.add(slot, params, prompt, [])
    expected = 30 if params.has_penalties else 12
    assert sampler.sample(logits, [0, 1, 2]).tolist() == [expected] * 3
    processed = sampler.processed_logits(logits[:1], [0])[0]
    assert torch.isfinite(processed.amax()) and int(processed.argmax()) == expected


def test_chains_sample_each_row_as_its_output_position_would() -> None:
    """A verify step's rows of one slot (Sampler.sample_chains) draw what plain decoding draws at
    those output positions: the seeded draw and the min_new_tokens ban follow the row's position."""
    v, gen = 16, torch.Generator().manual_seed(0)
    logits = torch.randn(6, v, generator=gen)
    logits[:, 5] += 4.0  # the stop id would win everywhere but for the ban
    params = SamplingParams(temperature=0.7, seed=11, min_new_tokens=3, max_new_tokens=20)
    plain, chains = Sampler(2, v, torch.device("cpu")), Sampler(2, v, torch.device("cpu"))
    for s in (plain, chains):
        s.add(1, params, [], stop_ids=[5])
    want = [int(plain.sample(logits[i : i + 1], [1])) for i in range(6)]
    got = chains.sample_chains(logits[:4], [1] * 4, [0, 1, 2, 3])
    chains.advance(1, 4)
    got += chains.sample_chains(logits[4:], [1] * 2, [0, 1])
    assert got == want and 5 not in want[:3]

"""RotaryEmbedding past its table: shift_keys re-rotates stored keys by a number of positions,
rows_for computes cos/sin rows for positions beyond max_positions (StreamingLLM-style retention)."""

from __future__ import annotations

import pytest
import torch
from radixrt.models.rope import RotaryEmbedding

HEAD_DIM, MAX = 64, 512
SCALINGS = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}  # fmt: skip
LONGROPE = {"rope_type": "longrope", "original_max_position_embeddings": 128,
            "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}  # fmt: skip


def _rope(kind: str, rotary_dim: int | None = None) -> RotaryEmbedding:
    return RotaryEmbedding(HEAD_DIM, MAX, 10000.0, SCALINGS[kind], rotary_dim)


def _k(t: int, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, 2, HEAD_DIM, generator=torch.Generator().manual_seed(seed)).to(dtype)  # [t, kv_heads, head_dim]


def _rotated_k(rope: RotaryEmbedding, rows: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return rope(rows, k, k)[1]


@pytest.mark.parametrize("kind", sorted(SCALINGS))
@pytest.mark.parametrize("rotary_dim", [None, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("delta", [37, -29])
def test_shift_keys_equals_rope_at_the_shifted_position(kind, rotary_dim, dtype, delta):
    rope = _rope(kind, rotary_dim)
    s = torch.arange(40, 200, 7)
    k = _k(len(s), dtype)
    got = rope.shift_keys(_rotated_k(rope, s, k), delta)
    want = _rotated_k(rope, s + delta, k)
    assert got.dtype == dtype
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=6e-2)
    torch.testing.assert_close(got, want, **tol)
    if rotary_dim is not None:  # the non-rotary dims are untouched
        assert torch.equal(got[..., rotary_dim:], k[..., rotary_dim:])


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_shifted_sinks_score_as_streamingllm_positions(kind):
    """q at p against a sink rotated at s then shifted by D scores as q at p - D against the sink at s."""
    rope, D = _rope(kind), 300
    s, p = torch.arange(4), torch.full((4,), 450)
    q, k = _k(4, seed=1), _k(4, seed=2)
    q_far, _ = rope(p, q, k)
    k_sink = rope.shift_keys(rope(s, q, k)[1], D)
    q_near, _ = rope(p - D, q, k)
    k_near = rope(s, q, k)[1]
    got = torch.einsum("thd,shd->hts", q_far, k_sink)
    want = torch.einsum("thd,shd->hts", q_near, k_near)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_rows_for_in_table_positions_are_themselves():
    rope = _rope("default")
    positions = torch.tensor([0, 5, MAX - 2, 100])
    rows, _ = rope.rows_for(positions)
    assert torch.equal(rows, positions)
    rows, grew = rope.rows_for(positions + 1)
    assert torch.equal(rows, positions + 1) and not grew


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_rows_for_far_positions_match_a_float64_reference(kind):
    rope = _rope(kind)
    table = rope.cos[:MAX].clone(), rope.sin[:MAX].clone()
    positions = torch.tensor([3, MAX, MAX + 5, 10 * MAX + 11, 100_003])
    rows, _ = rope.rows_for(positions)
    far = positions >= MAX
    assert torch.equal(rows[~far], positions[~far]) and bool((rows[far] >= MAX).all())
    angles = positions[far].double()[:, None] * rope.inv_freq.double()
    emb = torch.cat([angles, angles], dim=-1)
    torch.testing.assert_close(rope.cos[rows[far]].double(), emb.cos() * rope.attention_factor, rtol=0, atol=1e-6)
    torch.testing.assert_close(rope.sin[rows[far]].double(), emb.sin() * rope.attention_factor, rtol=0, atol=1e-6)
    assert torch.equal(rope.cos[:MAX], table[0]) and torch.equal(rope.sin[:MAX], table[1])  # table bit-identical


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_far_rows_rotate_consistently_with_the_table(kind):
    """Scores depend only on the position difference: q at MAX + 5, k at MAX - 2 (via rows_for)
    score as q at 100, k at 93 (in the table)."""
    rope = _rope(kind)
    q, k = _k(1, seed=3), _k(1, seed=4)
    rows, _ = rope.rows_for(torch.tensor([MAX + 5, MAX - 2]))
    qf, _ = rope(rows[:1], q, k)
    _, kf = rope(rows[1:], q, k)
    qn, kn = rope(torch.tensor([100]), q, k)
    _, kn = rope(torch.tensor([93]), q, k)
    torch.testing.assert_close((qf * kf).sum(-1), (qn * kn).sum(-1), rtol=1e-4, atol=1e-4)


def test_rows_for_grows_exactly_when_it_reallocates():
    rope = _rope("default")
    far = lambda t: torch.arange(MAX, MAX + t)  # noqa: E731
    cos = rope.cos
    for t, grows in [(3, True), (4, False), (1, False), (5, True), (8, False), (9, True), (16, False)]:
        _, grew = rope.rows_for(far(t))
        assert grew == grows == (rope.cos is not cos), t
        cos = rope.cos
    assert rope.cos.shape[0] == MAX + 16  # a power-of-two number of scratch rows


def test_longrope_refuses_both():
    rope = RotaryEmbedding(HEAD_DIM, MAX, 10000.0, LONGROPE)
    with pytest.raises(ValueError, match="longrope"):
        rope.shift_keys(_k(2), 3)
    with pytest.raises(ValueError, match="longrope"):
        rope.rows_for(torch.tensor([MAX + 1]))

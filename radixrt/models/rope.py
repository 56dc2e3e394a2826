"""Rotary position embeddings: inverse frequencies per rope_type, and their application.

Supported rope types: default, linear, llama3, yarn, longrope (each as transformers
5's modeling_rope_utils computes it). Anything else is an error naming the type,
never a silently different model.

YaRN and LongRoPE also scale cos and sin by an attention factor. LongRoPE has two
sets of frequencies: transformers uses the long ones for a forward whose positions
reach past original_max_position_embeddings, and Phi-3's generate recomputes the
whole sequence when it first grows past that length, so a sequence is computed
under one set: the short factors while it is at most that long, the long ones
after. The scheduler decides per request (Req.long_rope, recomputing a request
that crosses); RotaryEmbedding keeps both tables stacked ([short; long]) and
`table_rows` turns positions into rows of that stack.

Positions may pass the table: under bounded-KV retention (StreamingLLM's sinks and
recent window) a token is still computed at its original sequence position, and
generation may run past max_position_embeddings. `rows_for` computes the rows of
such positions into scratch rows appended after the table (one step's worth,
overwritten by the next call; the buffers grow, which moves them, when a step has
more tokens than scratch rows). `shift_keys` re-rotates stored keys by a number of
positions (the sinks, after tokens behind them are dropped). Both compute angles in
float64: position * inv_freq in float32 loses the angle's low bits once positions
are large (the in-table rows keep transformers' float32 angles, for parity).
Neither works for longrope, whose frequencies depend on the sequence's length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from radixrt.kernels.fused_layers import TORCH_LAYERS, TorchLayers, rotate

ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


@dataclass(frozen=True)
class RopeFrequencies:
    inv_freq: torch.Tensor  # [rotary_dim // 2] float32
    attention_factor: float = 1.0  # multiplies cos and sin


def rope_frequencies(
    rotary_dim: int, theta: float, scaling: dict[str, Any], max_positions: int, long: bool = False
) -> RopeFrequencies:
    """The inverse frequencies (and cos/sin factor) of one rope; `long` picks LongRoPE's long factors."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim  # [rotary_dim // 2]
    kind = scaling.get("rope_type", "default")
    if kind == "default":
        return RopeFrequencies(1.0 / (theta**exponents))
    if kind == "linear":
        return RopeFrequencies(1.0 / (theta**exponents) / scaling["factor"])
    if kind == "llama3":
        return RopeFrequencies(_llama3(1.0 / (theta**exponents), scaling))
    if kind == "yarn":
        return _yarn(rotary_dim, theta, theta**exponents, scaling, max_positions)
    if kind == "longrope":
        return _longrope(exponents, theta, scaling, max_positions, long)
    raise ValueError(f"rope_type {kind!r} is not supported ({', '.join(ROPE_TYPES)})")


def _llama3(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band in
    # between blended smoothly (Llama 3.1's context extension).
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(dim: int, base: float, pos_freqs: torch.Tensor, s: dict[str, Any], max_positions: int) -> RopeFrequencies:
    # Dimensions that turn many times within the original context keep their frequency
    # (extrapolate), slow ones are divided by `factor` (interpolate), with a linear ramp
    # between the dimensions where beta_fast and beta_slow rotations fit the old context.
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / old_len
    attention = s.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention = _yarn_mscale(factor)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over old_len
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_of(s.get("beta_fast") or 32), dim_of(s.get("beta_slow") or 1)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (original frequency), 0: interpolate (divided by factor)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return RopeFrequencies(inv_freq, float(attention))


def _longrope(
    exponents: torch.Tensor, theta: float, s: dict[str, Any], max_positions: int, long: bool
) -> RopeFrequencies:
    old_len = s["original_max_position_embeddings"]
    factor = s.get("factor") or max_positions / old_len
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    ext = torch.tensor(s["long_factor" if long else "short_factor"], dtype=torch.float32)
    if ext.shape != exponents.shape:
        raise ValueError(f"longrope {'long' if long else 'short'}_factor has {ext.numel()} values, not {exponents.numel()}")
    return RopeFrequencies(1.0 / (ext * theta**exponents), float(attention))


def _tables(freqs: RopeFrequencies, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """-> cos, sin: [max_positions, rotary_dim] float32, times the attention factor (as transformers)."""
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), freqs.inv_freq)
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos() * freqs.attention_factor, emb.sin() * freqs.attention_factor


class RotaryEmbedding(torch.nn.Module):
    """Neox-style rotation (rotate_half) of the first rotary_dim features of each head, as
    Hugging Face Llama/Qwen2/Phi-3 apply it, through `ops` (the compiled kernel or the torch path)."""

    ops: TorchLayers = TORCH_LAYERS

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any], rotary_dim: int | None = None
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim or head_dim
        self.partial = self.rotary_dim < head_dim
        self.max_positions = max_positions
        # longrope: a sequence longer than this runs under the long factors
        self.long_from: int | None = None
        freqs = rope_frequencies(self.rotary_dim, theta, scaling, max_positions)
        # NOTE: a plain attribute, not a buffer: model.to(bfloat16) would round a buffer.
        self.inv_freq = freqs.inv_freq  # [rotary_dim // 2] float32, where the model was built
        self.attention_factor = freqs.attention_factor
        self._inv_freq64: torch.Tensor | None = None  # inv_freq as float64 on the tables' device (cached)
        tables = [_tables(freqs, max_positions)]
        if scaling.get("rope_type") == "longrope":
            self.long_from = scaling["original_max_position_embeddings"]
            tables.append(_tables(rope_frequencies(self.rotary_dim, theta, scaling, max_positions, long=True), max_positions))
        # cos, sin: [max_positions * len(tables), rotary_dim]
        self.register_buffer("cos", torch.cat([c for c, _ in tables]), persistent=False)
        self.register_buffer("sin", torch.cat([s for _, s in tables]), persistent=False)
        self.table_len = self.cos.shape[0]  # rows past this are rows_for's scratch rows

    def table_rows(self, positions: torch.Tensor, long: torch.Tensor) -> torch.Tensor:
        """positions: [T] int64; long: [T] bool, the token's request runs under the long factors
        -> [T] rows of the stacked cos/sin tables."""
        assert self.long_from is not None, "only a longrope embedding has more than one table"
        return positions + long * self.max_positions

    def shift_keys(self, k: torch.Tensor, delta: int) -> torch.Tensor:
        """k: [T, kv_heads, head_dim] keys rotated at positions s -> the same keys rotated at
        s + delta (delta may be negative), in k's dtype. A pure rotation: the attention
        factor was applied when the keys were first rotated."""
        self._refuse_longrope("shift keys")
        angles = delta * self._freq64(k.device)  # [rotary_dim // 2] float64
        emb = torch.cat([angles, angles])  # [rotary_dim]
        cos, sin = emb.cos().float(), emb.sin().float()
        d = self.rotary_dim
        rotated = rotate(k[..., :d].float(), cos, sin).to(k.dtype)
        return torch.cat([rotated, k[..., d:]], dim=-1) if self.partial else rotated

    def rows_for(self, positions: torch.Tensor) -> tuple[torch.Tensor, bool]:
        """positions: [T] int64, any value >= 0 -> (rows [T] int64 of cos/sin, grew).

        A position inside the table is its own row; token i at a position past it gets
        scratch row table_len + i, written now (valid until the next call). So the rows
        depend only on the positions and table_len: ropes of one length (Gemma 3's two)
        agree, and each must be called. grew: cos/sin were reallocated (with room for
        the next power of two of T scratch rows), so CUDA graphs that captured the old
        buffers must be recaptured. No device-to-host sync: the scratch is sized by T,
        not by how many positions are far. Callers skip this when no position is far."""
        self._refuse_longrope("compute positions past the table")
        T = positions.shape[0]
        grew = self.cos.shape[0] - self.table_len < T
        if grew:
            self._grow_scratch(1 << max(T - 1, 0).bit_length())
        angles = positions.double()[:, None] * self._freq64(positions.device)  # [T, rotary_dim // 2] float64
        emb = torch.cat([angles, angles], dim=-1)  # [T, rotary_dim]
        scratch = slice(self.table_len, self.table_len + T)
        self.cos[scratch] = (emb.cos() * self.attention_factor).float()
        self.sin[scratch] = (emb.sin() * self.attention_factor).float()
        far = positions >= self.max_positions
        rows = torch.arange(self.table_len, self.table_len + T, dtype=torch.int64, device=positions.device)
        return torch.where(far, rows, positions), grew

    def _grow_scratch(self, n: int) -> None:
        """Reallocate cos/sin as [table_len + n, rotary_dim], the table rows copied exactly."""
        for name in ("cos", "sin"):
            old = getattr(self, name)
            new = old.new_empty(self.table_len + n, self.rotary_dim)
            new[: self.table_len] = old[: self.table_len]
            setattr(self, name, new)  # a registered buffer: nn.Module keeps it one

    def _freq64(self, device: torch.device) -> torch.Tensor:
        """inv_freq as float64 on `device` ([rotary_dim // 2]), copied there once."""
        if self._inv_freq64 is None or self._inv_freq64.device != device:
            self._inv_freq64 = self.inv_freq.to(device=device, dtype=torch.float64)
        return self._inv_freq64

    def _refuse_longrope(self, what: str) -> None:
        if self.long_from is not None:
            raise ValueError(f"a longrope embedding cannot {what}: its frequencies depend on the sequence's length")

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T] table rows (the positions, or table_rows' answer); q: [T, heads, head_dim];
        k: [T, kv_heads, head_dim] -> (q, k) rotated, new tensors (radixrt/kernels/fused_layers.py: rope_ref)."""
        return self.ops.rope(q, k, self.cos, self.sin, positions)

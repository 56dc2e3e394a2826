"""How the KV pool stores K and V: the formats of --kv-cache-dtype and their quantizers.

A format is one side's storage (K's, or V's): `auto` (the model's dtype as it is), fp8 (one
scale per layer, kv_cache.py), int8 (one float32 scale per token and KV head) or int4; the
setting's spelling (one format, or K:V) is radixrt/kv_settings.py's.

int4 stores two values per byte (element 2i in the low nibble, 2i + 1 in the high one) and one
float16 scale per group of INT4_GROUP elements of a token's head: in each group the element of
largest magnitude maps to -8 exactly (scale = that element / -8), the others round to the
nearest of -8..7 times the scale (all 16 levels in use). 4.5 bits per element with the scales.
A page holds its values and scales, so whatever moves pages moves both.

Keys may be stored rotated (`hadamard`): multiplied by a block-diagonal normalized Hadamard
matrix per head (blocks of the largest power of two dividing head_dim, at most 128), which
spreads an outlier channel over its block before the 4-bit grid cuts it. The matrix is its own
inverse, so a reader un-rotates with the same product, or rotates the queries instead:
q . k = (q H) . (k H). Values are stored as they are.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

INT8_MAX = 127
INT4_GROUP = 32  # elements of a token's head per float16 scale (radixrt/kv_settings.py names the same)
HADAMARD_MAX_BLOCK = 128


@dataclass(frozen=True)
class KVFormat:
    storage: torch.dtype | None  # None: the model's own dtype, stored as is
    token_scales: bool  # per-token scales beside the values (int8, int4); else one per layer (fp8)
    group: int = 0  # int4: elements per scale, two values per byte; 0: one value per element


KV_FORMATS = {
    "auto": KVFormat(None, False),
    "fp8_e4m3": KVFormat(torch.float8_e4m3fn, False),
    "fp8_e5m2": KVFormat(torch.float8_e5m2, False),
    "int8": KVFormat(torch.int8, True),
    "int4": KVFormat(torch.uint8, True, INT4_GROUP),
}


def split_formats(kv_dtype: str) -> tuple[KVFormat, KVFormat]:
    """kv_cache_dtype (one format, or K:V) -> K's and V's formats. The server checks the setting first
    (radixrt/kv_settings.py: the names, fp8 not mixed); a pool built directly gets a ValueError here."""
    names = kv_dtype.split(":")
    if not 1 <= len(names) <= 2 or any(n not in KV_FORMATS for n in names):
        raise ValueError(f"kv_cache_dtype formats are {', '.join(KV_FORMATS)} (or K:V of two); got {kv_dtype!r}")
    return KV_FORMATS[names[0]], KV_FORMATS[names[-1]]


def element_bytes(fmt: KVFormat, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one token's head on one side: values and their scales."""
    if fmt.group:
        return head_dim // 2 + 2 * (head_dim // fmt.group)
    return head_dim * (fmt.storage or dtype).itemsize + (4 if fmt.token_scales else 0)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, kv_heads, head_dim] -> int8 values of the same shape, float32 scales [T, kv_heads].

    Symmetric per (token, head): scale = amax / 127, so the largest |x| maps to +-127. An
    all-zero row gets scale 0 (the division is guarded), which reads back as exact zeros.
    """
    x = x.float()
    scale = x.abs().amax(-1) / INT8_MAX  # [T, kv_heads]
    q = torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None])
    return q.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def quantize_int4(x: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, kv_heads, D] -> packed uint8 [T, kv_heads, D / 2], float16 scales [T, kv_heads, D / group].
    The scale is rounded to float16 before the values are: they are quantized against the scale
    a reader sees. An all-zero group gets scale 0 and reads back as zeros."""
    T, H, D = x.shape
    g = x.float().view(T, H, D // group, group)
    peak = g.gather(-1, g.abs().argmax(-1, keepdim=True))  # the signed element of largest magnitude
    fmax = torch.finfo(torch.float16).max  # beyond 8 x 65504 values saturate at the scale's largest
    scale = (peak / -8).clamp_(-fmax, fmax).to(torch.float16)
    s = scale.float()
    inv = torch.where(s != 0, 1.0 / s, torch.zeros_like(s))
    q = (g * inv).round_().clamp_(-8, 7).add_(8).to(torch.uint8).view(T, H, D)
    return q[..., 0::2] | (q[..., 1::2] << 4), scale.view(T, H, D // group)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed [..., D / 2] uint8, scales [..., D / group] float16 -> [..., D] in dtype."""
    q = torch.stack((packed & 15, packed >> 4), dim=-1).view(*packed.shape[:-1], -1).float().sub_(8)
    groups = scales.shape[-1]
    return (q.view(*q.shape[:-1], groups, -1) * scales.float()[..., None]).view(q.shape).to(dtype)


def cast_saturating(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in dtype (round to nearest), clamped to dtype's finite range first.

    NOTE: float8_e4m3fn has no inf; an unclamped overflow would be stored as NaN.
    """
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-fmax, fmax).to(dtype)


def hadamard_block(head_dim: int) -> int:
    """The rotation's block: the largest power of two dividing head_dim, at most HADAMARD_MAX_BLOCK."""
    return min(head_dim & -head_dim, HADAMARD_MAX_BLOCK)


@functools.cache
def hadamard(head_dim: int) -> torch.Tensor:
    """[head_dim, head_dim] float32: block-diagonal normalized Hadamard (Sylvester), symmetric and
    orthogonal, so it is its own inverse."""
    b = hadamard_block(head_dim)
    h = torch.ones(1, 1)
    while h.shape[0] < b:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return torch.block_diag(*[h / math.sqrt(b)] * (head_dim // b))


def rotated(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] times the rotation, in float32 (applying it twice gives x back)."""
    return x.float() @ hadamard(x.shape[-1]).to(x.device)

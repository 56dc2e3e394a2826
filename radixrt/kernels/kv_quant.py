"""How the KV pool stores K and V: the formats of --kv-cache-dtype and their quantizers.

A format is one side's storage (K's, or V's): `auto` (the model's dtype as it is), fp8 (one
scale per layer, kv_cache.py), int8 (one float32 scale per token and KV head) or int4; the
setting's spelling (one format, or K:V) is radixrt/settings/kv.py's.

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

import ctypes
import functools
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from radixrt.kernels import native_build
from radixrt.kernels.int8_ops import load_int8_ops

logger = logging.getLogger(__name__)

INT8_MAX = 127
QUANTIZE_SOURCE = Path(__file__).parent / "csrc" / "kv_quantize.c"
INT4_GROUP = 32  # elements of a token's head per float16 scale (radixrt/settings/kv.py names the same)
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
    (radixrt/settings/kv.py: the names, fp8 not mixed); a pool built directly gets a ValueError here."""
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

    Symmetric per (token, head): scale = amax / 127, so the largest |x| maps to +-127, values
    x / scale rounded half to even. An all-zero row gets scale 1 and reads back as exact zeros.
    On the CPU this is the compiled per-row quantizer of the int8 GEMMs (int8_ops.py: the same
    arithmetic, held to the same torch reference), one pass instead of torch's several.
    """
    T, H, D = x.shape
    ops = load_int8_ops() if x.is_cpu else None
    if ops is not None and ops.takes(rows := x.reshape(T * H, D)):
        q, scale = ops.quantize_tokens(rows)
        return q.view(T, H, D), scale.view(T, H)
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    return torch.round(x / scale).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale[..., 0]


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


def store_int4(x: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scales: torch.Tensor) -> None:
    """values[slots], scales[slots] = quantize_int4(x), for x [T, kv_heads, D] float32 or bf16 and a pool's
    flat values [slots, kv_heads, D / 2] and scales [slots, kv_heads, D / 32]: on the CPU in one compiled
    pass into the pool (csrc/kv_quantize.c, bit for bit quantize_int4), elsewhere through torch."""
    quantize = _compiled_int4() if x.is_cpu and x.dtype in (torch.float32, torch.bfloat16) else None
    if quantize is None:
        values[slots], scales[slots] = quantize_int4(x)
        return
    T, H, D = x.shape
    x = x.contiguous()
    dst = (slots.to(torch.int64)[:, None] * H + torch.arange(H)).reshape(-1)
    err = quantize(x.data_ptr(), int(x.dtype == torch.bfloat16), T * H, D, dst.data_ptr(), values.data_ptr(),
                   scales.data_ptr(), torch.get_num_threads())
    if err:
        raise RuntimeError(f"int4 KV quantizer failed (code {err}: 1 unknown dtype, 2 head_dim not a multiple of 32)")


@functools.cache
def _compiled_int4():
    """The compiled int4 quantizer for this CPU, or None (logged once, with the reason) where it cannot be built."""
    try:
        isa = native_build.chosen_isa()
        fn = getattr(ctypes.CDLL(str(native_build.build(QUANTIZE_SOURCE, isa))), f"radixrt_quantize_int4_{isa.name}")
    except (OSError, RuntimeError, ValueError) as e:
        logger.warning("int4 KV: the compiled quantizer is unavailable (%s); quantizing through torch", e)
        return None
    p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.restype, fn.argtypes = ctypes.c_int, [p, i, i64, i, p, p, p, i]
    return fn


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

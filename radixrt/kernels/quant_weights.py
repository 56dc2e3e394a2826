"""Linear weights held quantized in groups of 32 along the input (what llama.cpp's Q4_0, Q4_1, Q4_K and Q8_0
tensors hold), and y = x W^T computed over them as they are (csrc/qgemm.c).

A QuantWeight is one [N, K] weight: 4-bit values w in 0..15 with a float16 scale d and min mn per group
(element = d w + mn; Q4_0's mn is -8 d, Q4_1's its min, Q4_K's sub-block scale and min folded into float16),
or 8-bit values in -127..127 with a float16 scale (element = d w). `pack` lays them out for the kernel
(outputs in tiles of 16, four elements of K per 32-bit lane: see qgemm.c); the layout does not depend on
the CPU, so a weight packs once at load. Bytes held per element: 4-bit 0.625, 8-bit 1.0625 (Q4_0's file
holds 0.5625, Q4_1's 0.625, Q4_K's 0.5625, Q8_0's 1.0625).

The kernel quantizes each activation row to int8 per group (its largest |x| / 127), sums each group's
products as integers (VNNI where the CPU has it), then scales them: `reference` is that arithmetic in
float64, which tests hold every variant to. Built per ISA by native_build.py; `load_qgemm` gives None,
logged with the reason, where it cannot be built.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from radixrt.kernels import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "qgemm.c"
GROUP, TILE = 32, 16
KINDS = {torch.float32: 0, torch.bfloat16: 1}
ERRORS = {1: "unknown activation dtype or bits", 2: "K not a multiple of 32 or N of 16", 3: "out of memory"}


@dataclass(frozen=True)
class QuantWeight:
    """An [N, K] weight as qgemm.c reads it (built by `pack`)."""

    bits: int  # 4 or 8
    out_features: int  # N
    in_features: int  # K
    packed: torch.Tensor  # uint8, N * K * bits / 8 bytes in the kernel's tile order
    scales: torch.Tensor  # float16 [N / 16, K / 32, 16]
    mins: torch.Tensor | None  # float16 like scales (4-bit), or None (8-bit)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins) if t is not None)


def pack(values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None) -> QuantWeight:
    """values [N, K]: uint8 0..15 (4-bit; then mins is given) or int8 -127..127 (8-bit); scales, mins
    [N, K / 32] (float16, or anything that rounds to it) -> the QuantWeight qgemm.c reads."""
    N, K = values.shape
    if K % GROUP or N % TILE:
        raise ValueError(f"a quantized weight needs in_features a multiple of {GROUP} and out_features of {TILE}; got [{N}, {K}]")
    bits = 4 if mins is not None else 8
    v = values.view(N // TILE, TILE, K)
    if bits == 4:  # lane n's dword j: k = 8j + b in byte b's low nibble, 8j + 4 + b in its high
        v = v.view(N // TILE, TILE, K // 8, 2, 4).to(torch.uint8)
        v = v[..., 0, :] | (v[..., 1, :] << 4)  # [tiles, 16, K / 8, 4]
    else:  # lane n's dword j: k = 4j + b in byte b
        v = v.view(torch.uint8).view(N // TILE, TILE, K // 4, 4)
    packed = v.transpose(1, 2).contiguous().view(-1)  # [tiles, dwords, 16, 4]

    def tiled(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float16).view(N // TILE, TILE, K // GROUP).transpose(1, 2).contiguous()

    return QuantWeight(bits, N, K, packed, tiled(scales), tiled(mins) if mins is not None else None)


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The [N, K] float32 weight w holds (each element d w + mn, or d w)."""
    N, K = w.out_features, w.in_features
    if w.bits == 4:
        b = w.packed.view(N // TILE, K // 8, TILE, 4)
        v = torch.stack((b & 15, b >> 4), dim=3).float()  # [tiles, K / 8, 16, 2, 4]: k = 8j + 4h + byte
        v = v.permute(0, 2, 1, 3, 4).reshape(N, K)
    else:
        v = w.packed.view(torch.int8).view(N // TILE, K // 4, TILE, 4).permute(0, 2, 1, 3).reshape(N, K).float()

    def per_element(t: torch.Tensor) -> torch.Tensor:
        return t.float().transpose(1, 2).reshape(N, K // GROUP).repeat_interleave(GROUP, dim=1)

    out = v * per_element(w.scales)
    return out + per_element(w.mins) if w.mins is not None else out


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as the kernel reads it: each group of 32 rounded to int8 against its largest |x| / 127
    (float32 arithmetic, as qgemm.c), read back in float32."""
    g = x.float().unflatten(-1, (-1, GROUP))
    amax = g.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # not 127.0 / amax: torch takes that as 127 * (1 / amax)
    return ((g * inv).round() * (amax / 127.0)).flatten(-2)


def reference(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The kernel's product in float64: x's rows quantized as it does, times the weight w holds."""
    return quantize_activations(x).double() @ dequantize(w).double().T


class QGemm:
    """The kernel built for one ISA."""

    def __init__(self, lib: Path, isa: native_build.Isa) -> None:
        self.isa = isa
        so = ctypes.CDLL(str(lib))
        self._fn, self._dequantize = (getattr(so, f"radixrt_{name}_{isa.name}") for name in ("qgemm", "qdequantize"))
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self._fn.restype, self._fn.argtypes = ctypes.c_int, [p, i, i64, i64, i64, p, i, p, p, p, i]
        self._dequantize.restype, self._dequantize.argtypes = ctypes.c_int, [p, i, p, p, i64, i64, p, i, i]

    def dequantize(self, w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
        """The [N, K] weight w holds, in dtype (float32, or bf16 rounded to nearest even): `dequantize`'s values."""
        out = torch.empty(w.out_features, w.in_features, dtype=dtype)
        err = self._dequantize(w.packed.data_ptr(), w.bits, w.scales.data_ptr(), w.mins.data_ptr() if w.mins is not None else None,
                               w.in_features, w.out_features, out.data_ptr(), KINDS[dtype], torch.get_num_threads())
        if err:
            raise RuntimeError(f"quantized weight dequantize ({self.isa.name}) failed: {ERRORS.get(err, err)}")
        return out

    def __call__(self, x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
        """x [M, K] float32 or bf16 -> x W^T [M, N] float32."""
        x = x.contiguous()
        M, K = x.shape
        assert K == w.in_features and x.dtype in KINDS and x.is_cpu
        out = torch.empty(M, w.out_features, dtype=torch.float32)
        err = self._fn(x.data_ptr(), KINDS[x.dtype], M, K, w.out_features, w.packed.data_ptr(), w.bits,
                       w.scales.data_ptr(), w.mins.data_ptr() if w.mins is not None else None, out.data_ptr(),
                       torch.get_num_threads())
        if err:
            raise RuntimeError(f"quantized GEMM ({self.isa.name}) failed: {ERRORS.get(err, err)}")
        return out


@functools.cache
def build_qgemm(isa: native_build.Isa) -> QGemm:
    """The kernel for isa, built if needed. Raises RuntimeError or OSError saying why it cannot be had."""
    return QGemm(native_build.build(SOURCE, isa), isa)


@functools.cache
def load_qgemm() -> QGemm | None:
    """The kernel for this CPU (native_build.chosen_isa), or None (logged once, with the reason)."""
    try:
        return build_qgemm(native_build.chosen_isa())
    except (OSError, RuntimeError, ValueError) as e:
        logger.warning("quantized weights: the compiled GEMM is unavailable (%s)", e)
        return None

"""Linear weights held quantized in groups of 32 along the input (what llama.cpp's Q4_0, Q4_1, Q4_K, Q5_0, Q5_1,
Q6_K and Q8_0 tensors hold), and y = x W^T computed over them as they are (csrc/qgemm.c).

A QuantWeight is one [N, K] weight in one of FORMATS: 4-bit values w in 0..15 or 5-bit in 0..31 with a float16
scale d and min mn per group (element = d w + mn; Q4_0's mn is -8 d, Q5_0's -16 d, Q4_1's and Q5_1's their min,
Q4_K's sub-block scale and min folded into float16), or 8-bit values in -127..127 with a float16 scale per 32
(Q8_0) or per 16 (Q6_K, its sub-block scales folded into float16) (element = d w). `pack` lays them out for
the kernel (outputs in tiles of 16, four elements of K per 32-bit lane, a 5-bit weight's fifth bits in a plane
after each group's nibbles: see qgemm.c); the layout does not depend on the CPU, so a weight packs once at load.
A 4- or 5-bit weight without mins (q4s, q5s: Q4_0's and Q5_0's) has the min -8 or -16 scales. Bytes held per
element: q4s 0.5625, q4 0.625, q5s 0.6875, q5 0.75, q8 1.0625, q8_16 1.125 (the files: Q4_0 0.5625, Q4_1
0.625, Q4_K 0.5625, Q5_0 0.6875, Q5_1 0.75, Q6_K 0.8203, Q8_0 1.0625).

The kernel quantizes each activation row to int8 per group (its largest |x| / 127), sums each scale block's
products as integers (VNNI where the CPU has it), then scales them: `reference` is that arithmetic in
float64, which tests hold every variant to. Built per ISA by native_build.py; `load_qgemm` gives None,
logged with the reason, where it cannot be built.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from radixrt.kernels import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "qgemm.c"
GROUP, TILE = 32, 16
KINDS = {torch.float32: 0, torch.bfloat16: 1}
ERRORS = {1: "unknown activation dtype, bits or scale group", 2: "K not a multiple of 32 or N of 16", 3: "out of memory",
          4: "Linux did not grant this process the AMX tile state"}


@dataclass(frozen=True)
class Format:
    """How a weight's values and scales are held."""

    name: str
    bits: int  # 4 or 5 (unsigned) or 8 (int8)
    sub: int  # elements per scale: 32, or 16 (8 bits only)
    has_min: bool  # a float16 min per 32 (4 and 5 bits); without, a 4- or 5-bit weight's min is -8 or -16 scales

    @property
    def nbytes_per_element(self) -> float:
        return self.bits / 8 + 2 / self.sub + (2 / 32 if self.has_min else 0)


FORMATS = {f.name: f for f in (Format("q4s", 4, 32, False), Format("q4", 4, 32, True), Format("q5s", 5, 32, False),
                               Format("q5", 5, 32, True), Format("q8", 8, 32, False), Format("q8_16", 8, 16, False))}  # smallest first


@dataclass(frozen=True)
class QuantWeight:
    """An [N, K] weight as qgemm.c reads it (built by `pack`)."""

    format: Format
    out_features: int  # N
    in_features: int  # K
    packed: torch.Tensor  # uint8, N * K * bits / 8 bytes in the kernel's tile order
    scales: torch.Tensor  # float16 [N / 16, K / sub, 16]
    mins: torch.Tensor | None  # float16 [N / 16, K / 32, 16] (formats with mins), or None

    @property
    def bits(self) -> int:
        return self.format.bits

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.mins) if t is not None)


def pack(values: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None = None, fmt: Format | None = None) -> QuantWeight:
    """values [N, K]: uint8 0..15 or 0..31, or int8 -127..127; scales [N, K / fmt.sub], mins [N, K / 32] where fmt
    has them (float16, or anything that rounds to it) -> the QuantWeight qgemm.c reads. fmt defaults to q8 for
    int8 values, else q4 (with mins) or q4s."""
    fmt = fmt or FORMATS["q8" if values.dtype == torch.int8 else "q4" if mins is not None else "q4s"]
    N, K = values.shape
    if K % GROUP or N % TILE:
        raise ValueError(f"a quantized weight needs in_features a multiple of {GROUP} and out_features of {TILE}; got [{N}, {K}]")
    if (mins is not None) != fmt.has_min:
        raise ValueError(f"format {fmt.name} {'needs' if fmt.has_min else 'takes no'} mins")
    T, G = N // TILE, K // GROUP
    if fmt.bits == 8:  # lane n's dword j: k = 4j + b in byte b
        v = values.view(torch.uint8).view(T, TILE, K // 4, 4)
        packed = v.transpose(1, 2).reshape(T, G, -1)
    else:  # lane n's dword j: k = 8j + b in byte b's low nibble, 8j + 4 + b in its high
        v = values.to(torch.uint8).view(T, TILE, K // 8, 2, 4)
        nibbles = ((v[..., 0, :] & 15) | ((v[..., 1, :] & 15) << 4)).transpose(1, 2).reshape(T, G, -1)  # [T, G, 256]
        packed = nibbles
        if fmt.bits == 5:  # bit j of lane n's byte b: the fifth bit of k = 4j + b
            fifth = ((values.to(torch.uint8) >> 4) & 1).view(T, TILE, G, 8, 4).to(torch.int32)
            plane = (fifth << torch.arange(8, dtype=torch.int32).view(8, 1)).sum(3).to(torch.uint8)  # [T, 16, G, 4]
            packed = torch.cat((nibbles, plane.transpose(1, 2).reshape(T, G, -1)), dim=2)

    def tiled(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float16).view(T, TILE, -1).transpose(1, 2).contiguous()

    return QuantWeight(fmt, N, K, packed.contiguous().view(-1), tiled(scales), tiled(mins) if mins is not None else None)


def held_rows(w: QuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows ids of the weight w holds, [len(ids), K] float32 (each element d w + mn, or d w)."""
    N, K, G = w.out_features, w.in_features, w.in_features // GROUP
    tile, lane, T = ids // TILE, ids % TILE, N // TILE
    groups = w.packed.view(T, G, -1)  # [tiles, G, the group's bytes]
    if w.bits == 8:
        values = groups.view(torch.int8).view(T, G, 8, TILE, 4)[tile, :, :, lane].float()  # [ids, G, 8, 4]: k = 4j + b
    else:
        nib = groups[..., :256].reshape(T, G, 4, TILE, 4)[tile, :, :, lane]  # [ids, G, 4, 4]
        values = torch.stack((nib & 15, nib >> 4), dim=3).view(-1, G, 8, 4).float()  # k = 8j + 4h + b
        if w.bits == 5:
            plane = groups[..., 256:].reshape(T, G, TILE, 4)[tile, :, lane]  # [ids, G, 4]
            values += ((plane.unsqueeze(2).int() >> torch.arange(8).view(8, 1)) & 1).float() * 16

    def per_element(t: torch.Tensor) -> torch.Tensor:
        return t[tile, :, lane].float().repeat_interleave(K // t.shape[1], dim=1)

    scales = per_element(w.scales)
    out = values.reshape(-1, K) * scales
    if w.mins is not None:
        return out + per_element(w.mins)
    return out - (1 << (w.bits - 1)) * scales if w.bits < 8 else out


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The [N, K] float32 weight w holds (each element d w + mn, or d w)."""
    return held_rows(w, torch.arange(w.out_features))


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

    def __init__(self, lib: Path, isa: native_build.Isa, entry: str = "qgemm") -> None:
        """entry: the product's entry point (qgemm: the integer tiles; qgemm_bf16: amx_bf16_tiles.h's)."""
        self.isa = isa
        self.name = isa.name if entry == "qgemm" else f"{isa.name}-{entry.removeprefix('qgemm_')}"  # a route's way
        so = ctypes.CDLL(str(lib))
        self._fn, self._dequantize = (getattr(so, f"radixrt_{name}_{isa.name}") for name in (entry, "qdequantize"))
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self._fn.restype, self._fn.argtypes = ctypes.c_int, [p, i, i64, i64, i64, p, i, i, p, p, p, i, i]
        self._dequantize.restype, self._dequantize.argtypes = ctypes.c_int, [p, i, i, p, p, i64, i64, p, i, i]

    def dequantize(self, w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
        """The [N, K] weight w holds, in dtype (float32, or bf16 rounded to nearest even): `dequantize`'s values,
        as the transpose of a contiguous [K, N] (the layout the kernel writes fastest; F.linear takes it as is)."""
        out = torch.empty(w.in_features, w.out_features, dtype=dtype)
        err = self._dequantize(w.packed.data_ptr(), w.bits, w.format.sub, w.scales.data_ptr(), _ptr(w.mins),
                               w.in_features, w.out_features, out.data_ptr(), KINDS[dtype], torch.get_num_threads())
        if err:
            raise RuntimeError(f"quantized weight dequantize ({self.isa.name}) failed: {ERRORS.get(err, err)}")
        return out.t()

    def __call__(self, x: torch.Tensor, w: QuantWeight, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """x [M, K] float32 or bf16 -> x W^T [M, N] in out_dtype (float32 or bf16, rounded to nearest even)."""
        return self.bind(w)(x, out_dtype)

    def bind(self, w: QuantWeight) -> Callable[[torch.Tensor, torch.dtype], torch.Tensor]:
        """`self(x, w, out_dtype)` as a function of (x, out_dtype) with w's pointers and sizes read once: a
        decode step calls it for every linear layer, where the Python around the product (6.3 us a call, 5.4 bound,
        on this AMX Xeon) is of the order of the product itself at one row (7-17 us on SmolLM2's shapes)."""
        fn, N, K, bits, sub = self._fn, w.out_features, w.in_features, w.bits, w.format.sub
        # NOTE: raw pointers: valid while w lives (the closure holds it: its error names w) and its tensors are not replaced (a
        # frozen QuantWeight's are not; a refilled weight is copied into them in place)
        packed, scales, mins = w.packed.data_ptr(), w.scales.data_ptr(), _ptr(w.mins)

        def product(x: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
            x = x.contiguous()
            M = x.shape[0]
            if x.shape[1] != K or x.dtype not in KINDS or not x.is_cpu:
                raise ValueError(f"quantized GEMM ({w.format.name} [{N}, {K}]) takes float32 or bf16 [M, {K}] on "
                                 f"the CPU, got {x.dtype} {list(x.shape)} on {x.device}")
            out = torch.empty(M, N, dtype=out_dtype)
            err = fn(x.data_ptr(), KINDS[x.dtype], M, K, N, packed, bits, sub, scales, mins, out.data_ptr(),
                     KINDS[out_dtype], torch.get_num_threads())
            if err:
                raise RuntimeError(f"quantized GEMM ({self.isa.name}) failed: {ERRORS.get(err, err)}")
            return out

        return product


def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


@functools.cache
def build_qgemm(isa: native_build.Isa) -> QGemm:
    """The kernel for isa, built if needed. Raises RuntimeError or OSError saying why it cannot be had."""
    return QGemm(native_build.build(SOURCE, isa), isa)


@functools.cache
def load_amx_qgemm() -> QGemm | None:
    """The AMX-INT8 kernel where the CPU has the tiles and it builds and runs (one product tried), else None
    (logged with the reason where the CPU has them)."""
    flags = native_build.cpu_flags() or frozenset()
    if not native_build.AMX.needs <= flags:
        return None
    try:
        kernel = build_qgemm(native_build.AMX)
        kernel(torch.zeros(1, GROUP), pack(torch.zeros(TILE, GROUP, dtype=torch.int8), torch.ones(TILE, 1)))
        return kernel
    except (OSError, RuntimeError) as e:
        logger.warning("quantized weights: the AMX-INT8 GEMM is unavailable (%s)", e)
        return None


@functools.cache
def load_amx_bf16_qgemm() -> QGemm | None:
    """The weight dequantized to bf16 a tile at a time through AMX-BF16 tiles (csrc/amx_bf16_tiles.h) where the
    CPU has them and it builds and runs (one product tried), else None (logged with the reason where it has them)."""
    if load_amx_qgemm() is None:
        return None
    try:
        kernel = QGemm(native_build.build(SOURCE, native_build.AMX), native_build.AMX, "qgemm_bf16")
        kernel(torch.zeros(1, GROUP), pack(torch.zeros(TILE, GROUP, dtype=torch.int8), torch.ones(TILE, 1)))
        return kernel
    except (OSError, RuntimeError) as e:
        logger.warning("quantized weights: the AMX-BF16 tiles are unavailable (%s)", e)
        return None


def tile_kernels() -> list[QGemm]:
    """The products besides the ISA's integer tiles that start-up may route rows to: the AMX-INT8 tiles and the
    AMX-BF16 ones over the weight dequantized a tile at a time, those this CPU runs."""
    return [k for k in (load_amx_qgemm(), load_amx_bf16_qgemm()) if k is not None]


@functools.cache
def load_qgemm() -> QGemm | None:
    """The kernel for this CPU (native_build.chosen_isa), or None (logged once, with the reason)."""
    try:
        return build_qgemm(native_build.chosen_isa())
    except (OSError, RuntimeError, ValueError) as e:
        logger.warning("quantized weights: the compiled GEMM is unavailable (%s)", e)
        return None

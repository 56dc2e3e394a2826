"""llama.cpp's quantized blocks, unpacked into what kernels/quant_weights.py packs: per [N, K] tensor its
values and per scale block (32 elements along K, or 16 for Q6_K) a scale and, for 4 and 5 bits, a min per 32,
so that an element is scale * value + min. Read from the raw bytes of a GGUF tensor (rows of blocks, as the
file holds them), never through float weights. The layouts are ggml's (gguf's quants.py reads the same):

  Q4_0  per 32: float16 d, 16 bytes; element i < 16 is byte i's low nibble, i >= 16 byte i - 16's high;
        element = d (n - 8)                                        -> q4s: scale d (exact)
  Q4_1  per 32: float16 d, float16 m, 16 bytes as Q4_0; element = d n + m   -> q4: scale d, min m (exact)
  Q5_0  per 32: float16 d, 4 bytes of fifth bits (bit i: element i), 16 bytes of low nibbles as Q4_0;
        element = d (n - 16)                                       -> q5s: scale d (exact)
  Q5_1  per 32: float16 d, float16 m, then as Q5_0; element = d n + m       -> q5: scale d, min m (exact)
  Q8_0  per 32: float16 d, 32 int8; element = d q                  -> q8: scale d (exact)
  Q4_K  per 256: float16 d and dmin, 12 bytes of 6-bit scales sc_j and mins m_j for 8 sub-blocks of 32,
        128 bytes: 32-byte chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high;
        element = d sc_j n - dmin m_j                              -> q4: scale d sc_j, min -dmin m_j, each
        rounded to float16 (a relative 2^-11 at most)
  Q6_K  per 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales sc_j (one per 16), float16 d;
        in each half of 128, element l + 32 i (l < 32, i < 4) takes nibble i / 2 of byte l + 32 (i % 2) and
        bits 2i, 2i + 1 of high byte l; element = d sc_j (n - 32)  -> q8_16: n - 32, scale d sc_j rounded
        to float16 (a relative 2^-11 at most)

A tensor unpacks to its own format (NATIVE) or, for a fused layer whose parts differ, to a wider one it
fits exactly (FITS: Q4_0 and Q5_0 take their min -8 d, -16 d where the format has mins, n + 8 in q5s, and
become int8 n - 8, n - 16; 4-bit values are 5-bit ones; a per-32 int8 scale repeats for each half).
"""

from __future__ import annotations

import numpy as np
import torch

from radixrt.kernels.quant_weights import FORMATS, Format

NATIVE = {"Q4_0": "q4s", "Q4_1": "q4", "Q4_K": "q4", "Q5_0": "q5s", "Q5_1": "q5", "Q8_0": "q8", "Q6_K": "q8_16"}
FITS = {"Q4_0": ("q4s", "q4", "q5s", "q5", "q8", "q8_16"), "Q4_1": ("q4", "q5"), "Q4_K": ("q4", "q5"),
        "Q5_0": ("q5s", "q5", "q8", "q8_16"), "Q5_1": ("q5",), "Q8_0": ("q8", "q8_16"), "Q6_K": ("q8_16",)}  # exact in
BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34), "Q4_K": (256, 144),
               "Q6_K": (256, 210)}  # (elements, bytes)


def layer_format(qtypes: set[str]) -> str | None:
    """The smallest format every one of a layer's tensor types fits exactly, or None."""
    if not qtypes or not qtypes <= FITS.keys():
        return None
    return next((f for f in FORMATS if all(f in FITS[t] for t in qtypes)), None)


def unpack(raw: np.ndarray, qtype: str, rows: int, cols: int, fmt: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, Format]:
    """raw: a tensor's bytes (rows x cols elements, cols along the blocks) -> (values [rows, cols] uint8 or int8,
    scales [rows, cols / sub] float16, mins [rows, cols / 32] float16 or None, the Format) in fmt (default: the
    type's own)."""
    fmt = fmt or NATIVE.get(qtype)
    if qtype not in BLOCK_BYTES or fmt not in FITS[qtype]:
        raise ValueError(f"GGUF type {qtype} is not held quantized as {fmt} (held: {', '.join(NATIVE)}; in {', '.join(FITS.get(qtype, ()))})")
    per, size = BLOCK_BYTES[qtype]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // per, size)
    values, scales, mins = _q4_k(blocks) if qtype == "Q4_K" else _q6_k(blocks) if qtype == "Q6_K" else _per_32(blocks, qtype)
    target = FORMATS[fmt]
    if qtype in ("Q4_0", "Q5_0"):  # n with min -offset d: as the target holds it
        offset = 8 if qtype == "Q4_0" else 16
        if target.bits == 8:
            values = (values.astype(np.int16) - offset).astype(np.int8)
        elif target.has_min:
            mins = scales * np.float16(-offset)
        else:
            values = values + np.uint8((1 << (target.bits - 1)) - offset)  # Q4_0 in q5s: n + 8
    if fmt == "q8_16" and qtype != "Q6_K":
        scales = np.repeat(scales.reshape(-1, 1), 2, axis=1)
    sub = FORMATS[fmt].sub

    def tensor(a: np.ndarray, width: int) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).view(rows, width)

    return tensor(values, cols), tensor(scales, cols // sub), tensor(mins, cols // 32) if mins is not None else None, FORMATS[fmt]


def _per_32(blocks: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Values, scales and (Q4_1, Q5_1) mins of the per-32 types; Q4_0's and Q5_0's n without their offset."""
    d = blocks[:, :2].copy().view(np.float16)  # [blocks, 1]
    if qtype == "Q8_0":
        return blocks[:, 2:].view(np.int8), d, None
    has_m = qtype in ("Q4_1", "Q5_1")
    start = 4 if has_m else 2
    mins = blocks[:, 2:4].copy().view(np.float16) if has_m else None
    fifth = None
    if qtype in ("Q5_0", "Q5_1"):
        fifth = ((blocks[:, start : start + 4].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        start += 4
    qs = blocks[:, start:]
    values = np.concatenate([qs & 15, qs >> 4], axis=1)
    return (values | (fifth << 4) if fifth is not None else values), d, mins


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n = blocks.shape[0]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = _k_scale_min(blocks[:, 4:16])
    qs = blocks[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    values = (qs & 15).reshape(n, 256)
    scales = (d * sc.astype(np.float32)).astype(np.float16)  # [n, 8]
    mins = (-(dmin * m.astype(np.float32))).astype(np.float16)
    return values, scales, mins


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, None]:
    n = blocks.shape[0]
    ql, qh = blocks[:, :128].reshape(n, 2, 2, 32), blocks[:, 128:192].reshape(n, 2, 1, 32)  # [n, half, i / 2, l]
    low = np.stack([ql & 15, ql >> 4], axis=2).reshape(n, 2, 4, 32)  # element l + 32 i: nibble i / 2 of ql[l + 32 (i % 2)]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3  # bits 2i, 2i + 1 of qh[l]
    values = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(n, 256)
    sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    return values, (d * sc).astype(np.float16), None


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each Q4_K block's 12 bytes: bytes 0-3 hold scales 0-3 (and the top
    bits of 4-7), bytes 4-7 mins 0-3 (likewise), bytes 8-11 the low bits of scales and mins 4-7."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn

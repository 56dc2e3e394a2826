"""llama.cpp's quantized blocks, unpacked into what kernels/quant_weights.py packs: per [N, K] tensor its
values (4-bit 0..15 or 8-bit int8) and per group of 32 along K a scale and, for 4 bits, a min, so that an
element is scale * value + min. Read from the raw bytes of a GGUF tensor (rows of blocks, as the file
holds them), never through float weights. The layouts are ggml's (gguf's quants.py reads the same):

  Q4_0  per 32: float16 d, 16 bytes; element i < 16 is byte i's low nibble, i >= 16 byte i - 16's high;
        element = d (n - 8)                                        -> scale d, min -8 d (exact)
  Q4_1  per 32: float16 d, float16 m, 16 bytes as Q4_0; element = d n + m   -> scale d, min m (exact)
  Q8_0  per 32: float16 d, 32 int8; element = d q                  -> scale d (exact)
  Q5_0  per 32: float16 d, 4 bytes of fifth bits (bit i: element i), 16 bytes of low nibbles as Q4_0;
        element = d (n - 16)                                       -> 8-bit n - 16, scale d (exact)
  Q4_K  per 256: float16 d and dmin, 12 bytes of 6-bit scales sc_j and mins m_j for 8 sub-blocks of 32,
        128 bytes: 32-byte chunk c holds sub-block 2c in its low nibbles, 2c + 1 in its high;
        element = d sc_j n - dmin m_j                              -> scale d sc_j, min -dmin m_j, each
        rounded to float16 (a relative 2^-11 at most: the only inexact one)
"""

from __future__ import annotations

import numpy as np
import torch

UNPACKED = ("Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q8_0")  # the types held quantized
BLOCK_BYTES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q4_K": (256, 144)}  # (elements, bytes)


def unpack(raw: np.ndarray, qtype: str, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """raw: a tensor's bytes (rows x cols elements, cols along the blocks) -> (values [rows, cols] uint8 0..15
    or int8, scales [rows, cols / 32] float16, mins [rows, cols / 32] float16 or None)."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {qtype} is not held quantized (held: {', '.join(UNPACKED)})")
    per, size = BLOCK_BYTES[qtype]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(rows * cols // per, size)
    if qtype == "Q4_K":
        values, scales, mins = _q4_k(blocks)
    else:
        d = blocks[:, :2].copy().view(np.float16)  # [blocks, 1]
        if qtype == "Q8_0":
            values, scales, mins = blocks[:, 2:].view(np.int8), d, None
        elif qtype == "Q5_0":
            fifth = (blocks[:, 2:6].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1  # [blocks, 32]
            qs = blocks[:, 6:]
            low = np.concatenate([qs & 15, qs >> 4], axis=1)
            values, scales, mins = ((low | (fifth.astype(np.uint8) << 4)).astype(np.int16) - 16).astype(np.int8), d, None
        else:
            qs = blocks[:, 4:] if qtype == "Q4_1" else blocks[:, 2:]
            values = np.concatenate([qs & 15, qs >> 4], axis=1)
            mins = blocks[:, 2:4].copy().view(np.float16) if qtype == "Q4_1" else (d * np.float16(-8))
            scales = d
    out_values = torch.from_numpy(np.ascontiguousarray(values)).view(rows, cols)
    out_scales = torch.from_numpy(np.ascontiguousarray(scales)).view(rows, cols // 32)
    return out_values, out_scales, torch.from_numpy(np.ascontiguousarray(mins)).view(rows, cols // 32) if mins is not None else None


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


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of each Q4_K block's 12 bytes: bytes 0-3 hold scales 0-3 (and the top
    bits of 4-7), bytes 4-7 mins 0-3 (likewise), bytes 8-11 the low bits of scales and mins 4-7."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn

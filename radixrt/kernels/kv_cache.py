"""The paged KV storage: per layer one K and one V tensor of fixed-size pages.

A token's KV lives at a *slot*: `page_id * page_size + offset`. The scheduler
decides which pages a request owns; this class only stores bytes. One extra,
zeroed page past the pool (`pad_slot`) is what padded reads point at: the
pool itself is uninitialized memory, and a masked position still multiplies
its value by 0, which is NaN if the garbage was NaN.

The pool may store K/V quantized (`kv_dtype`, the server's kv_cache_dtype):
  * int8: symmetric, one float32 scale per token and KV head (amax over
    head_dim / 127, round to nearest), kept in page-major tensors beside the
    values so that whatever copies pages copies the scales with them;
  * fp8_e4m3 / fp8_e5m2: one scale per layer for K and one for V, the scalar
    k_scale / v_scale FlashInfer's fp8 kernels take (dequantized = stored *
    scale). They start at 1.0; the worker's start-up check
    (radixrt/worker/kv_calibration.py) sets them from the K/V ranges it
    observes, or from --kv-scales-file. Values are clamped to the format's
    finite range before the cast, since float8_e4m3fn has no inf and an
    overflow would become NaN.
`read` always returns the model's dtype: there is no model-dtype copy of the
pool, so every attention path sees the same quantized-then-dequantized K/V.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INT8_MAX = 127


@dataclass(frozen=True)
class KVFormat:
    storage: torch.dtype | None  # None: the model's own dtype, stored as is
    token_scales: bool  # one float32 scale per token and KV head (int8); else one per layer (fp8)


# kv_cache_dtype -> how the pool stores K/V
KV_FORMATS = {
    "auto": KVFormat(None, False),
    "fp8_e4m3": KVFormat(torch.float8_e4m3fn, False),
    "fp8_e5m2": KVFormat(torch.float8_e5m2, False),
    "int8": KVFormat(torch.int8, True),
}


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, kv_heads, head_dim] -> int8 values of the same shape, float32 scales [T, kv_heads].

    Symmetric per (token, head): scale = amax / 127, so the largest |x| maps to +-127. An
    all-zero row gets scale 0 (the division is guarded), which reads back as exact zeros.
    """
    x = x.float()
    scale = x.abs().amax(-1) / INT8_MAX  # [T, kv_heads]
    q = torch.round(x / scale.clamp_min(torch.finfo(torch.float32).tiny)[..., None])
    return q.clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def cast_saturating(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """x / scale in dtype (round to nearest), clamped to dtype's finite range first.

    NOTE: float8_e4m3fn has no inf; an unclamped overflow would be stored as NaN.
    """
    fmax = torch.finfo(dtype).max
    return (x.float() / scale).clamp_(-fmax, fmax).to(dtype)


def _flat(buf: torch.Tensor) -> torch.Tensor:
    """[num_pages + 1, page_size, ...] -> [slots, ...] (a view)."""
    return buf.view(-1, *buf.shape[2:])


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: str = "auto",
    ) -> None:
        if kv_dtype not in KV_FORMATS:
            raise ValueError(f"kv_cache_dtype must be one of {tuple(KV_FORMATS)}, got {kv_dtype!r}")
        fmt = KV_FORMATS[kv_dtype]
        self.num_pages = num_pages  # usable pages; page `num_pages` is the zeroed padding page
        self.page_size = page_size
        self.pad_slot = num_pages * page_size
        self.kv_dtype = kv_dtype
        self.dtype = dtype  # the model's dtype: what read() returns
        self.storage_dtype = fmt.storage or dtype  # what the pool holds
        self.quantized = fmt.storage is not None
        self.layer_scaled = self.quantized and not fmt.token_scales  # fp8: k_scale / v_scale per layer
        shape = (num_pages + 1, page_size, num_kv_heads, head_dim)
        # NOTE: torch.empty, not zeros: a large pool is then committed by the OS
        # page by page as it is written. Only the padding page is zeroed.
        # k[layer], v[layer]: [num_pages + 1, page_size, kv_heads, head_dim] storage_dtype
        self.k = [torch.empty(shape, dtype=self.storage_dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.empty(shape, dtype=self.storage_dtype, device=device) for _ in range(num_layers)]
        # int8 only: k_scales[layer], v_scales[layer]: [num_pages + 1, page_size, kv_heads] float32
        n_scaled = num_layers if fmt.token_scales else 0
        self.k_scales = [torch.empty(shape[:3], dtype=torch.float32, device=device) for _ in range(n_scaled)]
        self.v_scales = [torch.empty(shape[:3], dtype=torch.float32, device=device) for _ in range(n_scaled)]
        # Per-tensor scales (dequantized = stored * scale): used by fp8, 1.0 (identity) otherwise.
        self.k_scale = [1.0] * num_layers
        self.v_scale = [1.0] * num_layers
        # Every tensor holding per-token KV state, page-major: copying buf[page_ids] for each
        # moves pages whole (values and their scales).
        self.buffers: list[torch.Tensor] = [*self.k, *self.v, *self.k_scales, *self.v_scales]
        for buf in self.buffers:
            buf[num_pages].zero_()

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: str = "auto"
    ) -> int:
        """Pool bytes one token takes across layers: K and V values, plus int8's float32 scales."""
        fmt = KV_FORMATS[kv_dtype]
        per_head = head_dim * (fmt.storage or dtype).itemsize + (4 if fmt.token_scales else 0)
        return 2 * num_layers * num_kv_heads * per_head

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store (quantize) the new tokens' K/V. slots: [T] int64; k, v: [T, kv_heads, head_dim]."""
        for side, x in zip(self._sides(layer), (k, v)):
            self._store(*side, slots, x)

    def write_keys(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Overwrite (quantize) only the keys at slots, their values untouched (re-rotated sinks)."""
        self._store(*self._sides(layer)[0], slots, k)

    def read_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Gather only the keys at slots (any shape S) -> [*S, kv_heads, head_dim] in the model's dtype."""
        return self._load(*self._sides(layer)[0], slots)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V at slots (any shape S) -> two tensors [*S, kv_heads, head_dim] in the model's dtype."""
        k, v = (self._load(*side, slots) for side in self._sides(layer))
        return k, v

    def read_heads(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V at slots [B, T] -> two tensors [B, kv_heads, T, head_dim] float32, head-major
        (what a matmul per KV head reads); values as read() returns them, then widened.
        One pass after the gather both converts and reorders."""
        out = []
        for side in self._sides(layer):
            x = self._load(*side, slots)  # [B, T, kv_heads, head_dim]
            heads = torch.empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3], dtype=torch.float32, device=x.device)
            out.append(heads.copy_(x.transpose(1, 2)))
        return out[0], out[1]

    def _sides(self, layer: int) -> tuple[tuple, tuple]:
        """(values, per-token scales or None, per-tensor scale) of K, then of V."""
        k_token = self.k_scales[layer] if self.k_scales else None
        v_token = self.v_scales[layer] if self.v_scales else None
        return (self.k[layer], k_token, self.k_scale[layer]), (self.v[layer], v_token, self.v_scale[layer])

    def _store(
        self, buf: torch.Tensor, token_scales: torch.Tensor | None, scale: float, slots: torch.Tensor, x: torch.Tensor
    ) -> None:
        if token_scales is not None:  # int8
            _flat(buf)[slots], _flat(token_scales)[slots] = quantize_int8(x)
        elif self.quantized:  # fp8
            _flat(buf)[slots] = cast_saturating(x, scale, buf.dtype)
        else:
            _flat(buf)[slots] = x.to(buf.dtype)

    def _load(
        self, buf: torch.Tensor, token_scales: torch.Tensor | None, scale: float, slots: torch.Tensor
    ) -> torch.Tensor:
        # NOTE: index_select on the flattened slots, not buf[slots]: advanced indexing with a
        # 2-D index is ~10x slower on CPU (measured: 9.8 ms vs 0.6 ms for [64, 600] slots).
        flat_slots = slots.reshape(-1)
        values = _flat(buf).index_select(0, flat_slots).view(*slots.shape, *buf.shape[2:])  # storage_dtype
        if token_scales is not None:  # int8
            scales = _flat(token_scales).index_select(0, flat_slots).view(*slots.shape, buf.shape[2])
            return (values.float() * scales[..., None]).to(self.dtype)
        if self.quantized:  # fp8
            return (values.float() * scale).to(self.dtype)
        return values

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V (and scales) from slots src to slots dst (copy-on-write of a page)."""
        for buf in self.buffers:
            flat = _flat(buf)
            flat[dst] = flat[src]

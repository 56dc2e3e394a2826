"""The paged KV storage: per layer one K and one V tensor of fixed-size pages.

A token's KV lives at a *slot*: `page_id * page_size + offset`. The scheduler
decides which pages a request owns; this class only stores bytes. One extra,
zeroed page past the pool (`pad_slot`) is what padded reads point at: the
pool itself is uninitialized memory, and a masked position still multiplies
its value by 0, which is NaN if the garbage was NaN.

The pool may store K/V quantized (`kv_dtype`, the server's kv_cache_dtype: one
format for both sides, or K's and V's as `K:V`; the formats are kv_quant.py's):
  * int8: symmetric, one float32 scale per token and KV head (amax over
    head_dim / 127, round to nearest; 1 for an all-zero row);
  * int4: two values per byte, one float16 scale per 32 elements of a token's
    head; keys rotated by a Hadamard matrix first where `rotate_k` (by default
    wherever K is int4), which reads undo;
  * fp8_e4m3 / fp8_e5m2: one scale per layer for K and one for V, the scalar
    k_scale / v_scale FlashInfer's fp8 kernels take (dequantized = stored *
    scale). They start at 1.0; the worker's start-up check
    (radixrt/worker/kv_calibration.py) sets them from the K/V ranges it
    observes, or from --kv-scales-file. Values are clamped to the format's
    finite range before the cast, since float8_e4m3fn has no inf and an
    overflow would become NaN.
Per-token scales live in page-major tensors beside the values (`buffers`), so
whatever copies pages (copy-on-write, the host and disk tiers, swaps) copies the
scales with them. `read` always returns the model's dtype: there is no model-dtype
copy of the pool, so every attention path sees the same quantized-then-dequantized K/V.
"""

from __future__ import annotations

import torch

from radixrt.kernels.kv_quant import (
    KVFormat, cast_saturating, dequantize_int4, element_bytes, quantize_int8, rotated, split_formats, store_int4,
)  # fmt: skip


def _flat(buf: torch.Tensor) -> torch.Tensor:
    """[num_pages + 1, page_size, ...] -> [slots, ...] (a view)."""
    return buf.view(-1, *buf.shape[2:])


class KVSide:
    """One side's (K's or V's) storage over all layers: values, per-token scales, per-layer scales."""

    def __init__(self, fmt: KVFormat, num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device, rotate: bool) -> None:
        self.fmt, self.rotate, self.dtype = fmt, rotate, dtype
        self.storage = fmt.storage or dtype
        pages, page_size, heads, head_dim = shape
        values = (pages, page_size, heads, head_dim // 2) if fmt.group else shape
        # NOTE: torch.empty, not zeros: a large pool is then committed by the OS page by page as
        # it is written. Only the padding page is zeroed (by PagedKVCache). Not in huge pages
        # (kernels/huge_pages.py): measured on an AMX Xeon, W2 on SmolLM2 0.86-0.91x with them, each 2 MiB
        # first written costing a fault that zeroes (and may compact) all of it, and batch-1 decode no faster.
        self.values = [torch.empty(values, dtype=self.storage, device=device) for _ in range(num_layers)]
        scales = ((pages, page_size, heads, head_dim // fmt.group), torch.float16) if fmt.group else (shape[:3], torch.float32)
        n_scaled = num_layers if fmt.token_scales else 0
        self.token_scales = [torch.empty(scales[0], dtype=scales[1], device=device) for _ in range(n_scaled)]
        self.layer_scale = [1.0] * num_layers  # fp8's (dequantized = stored * scale); 1.0 otherwise

    def store(self, layer: int, slots: torch.Tensor, x: torch.Tensor) -> None:
        if self.rotate:
            x = rotated(x)
        buf = _flat(self.values[layer])
        if self.fmt.group:
            store_int4(x, slots, buf, _flat(self.token_scales[layer]))
        elif self.fmt.token_scales:
            buf[slots], _flat(self.token_scales[layer])[slots] = quantize_int8(x)
        elif self.fmt.storage is not None:  # fp8
            buf[slots] = cast_saturating(x, self.layer_scale[layer], buf.dtype)
        else:
            buf[slots] = x.to(buf.dtype)

    def load(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        # NOTE: index_select on the flattened slots, not buf[slots]: advanced indexing with a
        # 2-D index is ~10x slower on CPU (measured: 9.8 ms vs 0.6 ms for [64, 600] slots).
        flat_slots = slots.reshape(-1)
        buf = self.values[layer]
        values = _flat(buf).index_select(0, flat_slots).view(*slots.shape, *buf.shape[2:])  # storage dtype
        if self.fmt.token_scales:
            scales = _flat(self.token_scales[layer]).index_select(0, flat_slots)
            if self.fmt.group:  # int4
                x = dequantize_int4(values, scales.view(*slots.shape, *scales.shape[1:]), torch.float32)
            else:  # int8
                x = values.float() * scales.view(*slots.shape, buf.shape[2])[..., None]
        elif self.fmt.storage is not None:  # fp8
            x = values.float() * self.layer_scale[layer]
        else:
            x = values
        return (rotated(x) if self.rotate else x).to(self.dtype)


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
        rotate_k: bool | None = None,
    ) -> None:
        """kv_dtype: one format, or K:V (kv_quant.split_formats); rotate_k: store keys rotated
        (None: wherever K is int4)."""
        k_fmt, v_fmt = split_formats(kv_dtype)
        if any(f.group and head_dim % f.group for f in (k_fmt, v_fmt)):
            raise ValueError(f"kv_cache_dtype {kv_dtype!r}: int4 needs head_dim a multiple of {k_fmt.group or v_fmt.group}, "
                             f"not {head_dim}")
        self.num_pages = num_pages  # usable pages; page `num_pages` is the zeroed padding page
        self.page_size = page_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim  # (int4 values hold head_dim / 2 bytes)
        self.pad_slot = num_pages * page_size
        self.kv_dtype = kv_dtype
        self.dtype = dtype  # the model's dtype: what read() returns
        self.rotate_k = bool(k_fmt.group) if rotate_k is None else rotate_k
        if self.rotate_k and k_fmt.storage is None:
            raise ValueError("rotating the keys is for a quantized K (kv_cache_dtype's K side is the model's dtype)")
        shape = (num_pages + 1, page_size, num_kv_heads, head_dim)
        self.k_side = KVSide(k_fmt, num_layers, shape, dtype, device, self.rotate_k)
        self.v_side = KVSide(v_fmt, num_layers, shape, dtype, device, False)
        # what the pool holds: the one format both sides store (None where they differ); FlashInfer and
        # the compiled kernel serve only such pools of the formats they know (int4: uint8, packed)
        self.storage_dtype = self.k_side.storage if k_fmt == v_fmt else None
        self.quantized = k_fmt.storage is not None or v_fmt.storage is not None
        # fp8 (never mixed): a scale per layer, fitted at start
        self.layer_scaled = any(f.storage is not None and not f.token_scales for f in (k_fmt, v_fmt))
        # k[layer], v[layer]: [num_pages + 1, page_size, kv_heads, head_dim] (int4: head_dim / 2 bytes)
        self.k, self.v = self.k_side.values, self.v_side.values
        # per-token scales: int8 [num_pages + 1, page_size, kv_heads] float32, int4 [..., head_dim / 32] float16
        self.k_scales, self.v_scales = self.k_side.token_scales, self.v_side.token_scales
        # Per-tensor scales (dequantized = stored * scale): used by fp8, 1.0 (identity) otherwise.
        self.k_scale, self.v_scale = self.k_side.layer_scale, self.v_side.layer_scale
        # Every tensor holding per-token KV state, page-major: copying buf[page_ids] for each
        # moves pages whole (values and their scales).
        self.buffers: list[torch.Tensor] = [*self.k, *self.v, *self.k_scales, *self.v_scales]
        for buf in self.buffers:
            buf[num_pages].zero_()

    @staticmethod
    def bytes_per_token(
        num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, kv_dtype: str = "auto"
    ) -> int:
        """Pool bytes one token takes across layers: K and V values, plus their per-token scales."""
        return num_layers * num_kv_heads * sum(element_bytes(fmt, head_dim, dtype) for fmt in split_formats(kv_dtype))

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store (quantize) the new tokens' K/V. slots: [T] int64; k, v: [T, kv_heads, head_dim]."""
        self.k_side.store(layer, slots, k)
        self.v_side.store(layer, slots, v)

    def write_keys(self, layer: int, slots: torch.Tensor, k: torch.Tensor) -> None:
        """Overwrite (quantize) only the keys at slots, their values untouched (re-rotated sinks)."""
        self.k_side.store(layer, slots, k)

    def read_keys(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Gather only the keys at slots (any shape S) -> [*S, kv_heads, head_dim] in the model's dtype."""
        return self.k_side.load(layer, slots)

    def read(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V at slots (any shape S) -> two tensors [*S, kv_heads, head_dim] in the model's dtype."""
        return self.k_side.load(layer, slots), self.v_side.load(layer, slots)

    def read_heads(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather K/V at slots [B, T] -> two tensors [B, kv_heads, T, head_dim] float32, head-major
        (what a matmul per KV head reads); values as read() returns them, then widened.
        One pass after the gather both converts and reorders."""
        out = []
        for x in self.read(layer, slots):  # [B, T, kv_heads, head_dim]
            heads = torch.empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3], dtype=torch.float32, device=x.device)
            out.append(heads.copy_(x.transpose(1, 2)))
        return out[0], out[1]

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V (and scales) from slots src to slots dst (copy-on-write of a page)."""
        for buf in self.buffers:
            flat = _flat(buf)
            flat[dst] = flat[src]

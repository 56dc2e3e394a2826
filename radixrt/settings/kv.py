"""The device KV pool: its size (pages, tokens, memory), its storage format (--kv-cache-dtype,
--kv-cache-rotation) and the checks of quantized KV (at start and in idle time); their names and
checks without torch, so the CLI and the config read them without loading it.

--kv-cache-dtype names one format for K and V, or K's then V's as `K:V` (`int8:int4`: int8 keys,
int4 values; K is the more sensitive half). The formats are radixrt/kernels/kv_quant.py's. fp8's
per-layer scales are fitted for K and V together, so fp8 does not mix with another format.
--kv-cache-rotation: whether keys are stored rotated by a Hadamard matrix per head (kv_quant.py):
auto wherever K is int4, on for any quantized K, off never.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from radixrt.settings.fields import arg, check_at_least, check_fraction

KV_FORMAT_NAMES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
KV_ROTATIONS = ("auto", "on", "off")
# The quantized-KV start-up check's default floor (radixrt/worker/kv_calibration.py), set from the
# real trained model SmolLM2-135M-Instruct on the check's built-in prompts (663 positions,
# tests/test_real_model.py): int8 agrees 0.989 in float32 and 0.959 in bf16, fp8_e4m3 0.952 and
# 0.940, fp8_e5m2 0.926 and 0.910. The former floor of 0.9 passed bf16 fp8_e5m2 by 6 positions,
# so another prompt set or CPU could refuse a healthy pool. 0.85 passes every healthy pool by
# at least 0.06 and still refuses fp8 scales that clip (0.70). Random-weight tiny models, whose
# near-tied logits flip, agree 0.95 (int8) and 0.60-0.78 (fp8). int8 weights (w8a8_int8) agree
# 0.935 in float32 (tests/test_real_model_quant.py holds them to this floor too).
KV_QUANT_MIN_AGREEMENT = 0.85
INT4_GROUP = 32  # elements of a token's head per int4 scale
# SGLang's 4-bit name is a float format (e2m1 with block exponents): not this store's integer grid
REFUSED = {"fp4_e2m1": "kv_cache_dtype fp4_e2m1 (SGLang's e2m1 floats with block exponents) is not implemented "
                       "here; int4 stores 4-bit KV (integers, a float16 scale per 32 elements)"}


def split_kv_dtype(kv_dtype: str) -> tuple[str, str]:
    """kv_cache_dtype -> (K's format, V's format). Raises ValueError naming what is wrong."""
    sides = kv_dtype.split(":")
    if len(sides) > 2 or not all(sides):
        raise ValueError(f"kv_cache_dtype is one format, or K's and V's as K:V; got {kv_dtype!r}")
    for s in sides:
        if s in REFUSED:
            raise ValueError(REFUSED[s])
        if s not in KV_FORMAT_NAMES:
            raise ValueError(f"kv_cache_dtype formats are {', '.join(KV_FORMAT_NAMES)} (or K:V of two); got {s!r}")
    k, v = sides[0], sides[-1]
    if k != v and "fp8" in k + v:
        raise ValueError(f"kv_cache_dtype {kv_dtype!r}: fp8's per-layer scales are fitted for K and V together; "
                         "it does not mix with another format")
    return k, v


def rotates_keys(kv_dtype: str, rotation: str) -> bool:
    """Whether keys are stored rotated under --kv-cache-rotation (checked by check_kv_args)."""
    k, _ = split_kv_dtype(kv_dtype)
    return rotation == "on" or (rotation == "auto" and k == "int4")


def check_kv_args(kv_dtype: str, rotation: str) -> None:
    k, _ = split_kv_dtype(kv_dtype)
    if rotation not in KV_ROTATIONS:
        raise ValueError(f"kv_cache_rotation must be one of {KV_ROTATIONS}, got {rotation!r}")
    if rotation == "on" and k == "auto":
        raise ValueError("kv_cache_rotation on rotates quantized keys; kv_cache_dtype stores K in the model's dtype")


def check_head_dim(kv_dtype: str, head_dim: int) -> None:
    """int4 groups a head's elements by INT4_GROUP: a head_dim they do not divide is refused by name."""
    if "int4" in split_kv_dtype(kv_dtype) and head_dim % INT4_GROUP:
        raise ValueError(f"kv_cache_dtype {kv_dtype!r}: int4 needs head_dim a multiple of {INT4_GROUP}, not {head_dim}")


@dataclass(frozen=True)
class KVArgs:
    page_size: int = arg(1, "tokens per KV page")
    max_total_tokens: int | None = arg(None, "KV pool size in tokens (overrides mem_fraction_static)")
    mem_fraction_static: float | None = arg(
        None, "fraction of device memory for weights + KV pool (default 0.88 on CUDA, 0.3 of available RAM on CPU)"
    )
    kv_cache_dtype: str = arg(
        "auto", "KV pool storage: auto (the model's dtype), fp8_e4m3, fp8_e5m2, int8 or int4 (a float16 scale per 32 "
        "elements); K:V for keys and values apart, e.g. int8:int4 (fp8 does not mix)"
    )
    kv_cache_rotation: str = arg(
        "auto", "store keys rotated by a Hadamard matrix per head, which spreads outlier channels before they are "
        "quantized (queries are rotated alike: scores unchanged): auto (where keys are int4), on (any quantized "
        "keys), off"
    )
    kv_calibration_file: str | None = arg(
        None, "text file of calibration prompts (paragraphs separated by blank lines) for the quantized-KV start-up "
        "check (default: built-in prose, a number table and code)"
    )
    kv_scales_file: str | None = arg(
        None, 'fp8 KV per-layer scales, JSON {"k_scale": [...], "v_scale": [...]} (default: fitted to the K/V '
        "ranges of the start-up check)"
    )
    kv_quant_min_agreement: float = arg(
        KV_QUANT_MIN_AGREEMENT, "with a quantized kv_cache_dtype, refuse to start when the start-up check's top-1 "
        "agreement with model-dtype KV is below this"
    )
    quality_spot_check_rate: float = arg(
        0.0, "fraction of finished greedy requests re-scored in idle time against model-dtype KV with no retention and "
        "no cache reuse (top-1 agreement and mean |delta logprob| of the emitted tokens, in /metrics); 0: off"
    )
    quality_spot_check_min_agreement: float = arg(
        0.9, "a spot check whose top-1 agreement is below this logs a warning (at most once a minute)"
    )
    quality_spot_check_queue: int = arg(64, "spot checks waiting for idle time at most; older ones are skipped")

    def check(self) -> None:
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens must be >= page_size, got {self.max_total_tokens}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        check_kv_args(self.kv_cache_dtype, self.kv_cache_rotation)
        if self.kv_scales_file is not None and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(f"kv_scales_file holds fp8 scales; kv_cache_dtype is {self.kv_cache_dtype!r}")
        for name in ("kv_calibration_file", "kv_scales_file"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ValueError(f"{name} {path!r} is not a file")
        check_fraction(self, ("kv_quant_min_agreement", "quality_spot_check_rate", "quality_spot_check_min_agreement"))
        check_at_least(self, ("quality_spot_check_queue",), 1)

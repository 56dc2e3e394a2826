"""The KV pool's storage settings (--kv-cache-dtype, --kv-cache-rotation): their names and checks,
without torch, so the CLI and the config read them without loading it.

--kv-cache-dtype names one format for K and V, or K's then V's as `K:V` (`int8:int4`: int8 keys,
int4 values; K is the more sensitive half). The formats are radixrt/kernels/kv_quant.py's. fp8's
per-layer scales are fitted for K and V together, so fp8 does not mix with another format.
--kv-cache-rotation: whether keys are stored rotated by a Hadamard matrix per head (kv_quant.py):
auto wherever K is int4, on for any quantized K, off never.
"""

from __future__ import annotations

KV_FORMAT_NAMES = ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
KV_ROTATIONS = ("auto", "on", "off")
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

"""The compiled CPU paged-attention kernel (csrc/paged_attention.c): build, load, call.

Decodes, prefill chunks over a cached prefix and a cascade's shared prefix, the pool read
in place. One C source, built per instruction set by native_build.py (AVX-512, AVX2,
scalar: every variant builds on any x86 machine); which variant serves each kind of call is
kernel_choice.py's measurement, or the one RADIXRT_CPU_KERNEL_ISA names. The brgemm variant
runs a bf16 pool's many-row tasks as tile products through torch's own oneDNN micro-kernel
(at::native::cpublas::brgemm, on AMX tiles where the CPU has them), its functions looked up in
libtorch_cpu and handed to the C source by address. Plain C through ctypes, not a torch extension:
no torch headers to compile (a build takes about a second) and nothing for the user to
install. Where it cannot build, the caller keeps the torch path (decode_attention.py)
and the log says why, once.

It serves pools of float32, bfloat16, int4 and int8 (each block's rows dequantized once, in the
kernel; with VNNI, an int4 pool's scores by integer dot products: csrc/quant_rows.h); fp8,
float16 and mixed K:V pools take the torch path, which dequantizes them.
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch

from radixrt.kernels.native_build import Isa, build

SOURCE = Path(__file__).parent / "csrc" / "paged_attention.c"
KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.uint8: 2, torch.int8: 3}  # pool dtype -> the kernel's `kind` (uint8: int4, packed)
ERRORS = {1: "unknown pool dtype", 2: "heads not a multiple of KV heads", 3: "out of memory",
          4: "negative window or soft cap", 5: "head_dim not a multiple of the variant's vector lanes",
          6: "a request with no queries, or more than its tokens", 7: "its brgemm functions were not set",
          8: "a quantized pool needs head_dim at most 256 (int4: a multiple of 32) and its scales"}  # fmt: skip
# at::native::cpublas's brgemm (bf16 x bf16 -> float32), pack and brgemm_release, as libtorch_cpu exports them
BRGEMM_SYMBOLS = ("_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb",
                  "_ZN2at6native7cpublas4packEllllN3c1010ScalarTypeES3_PKvPv",
                  "_ZN2at6native7cpublas14brgemm_releaseEb")  # fmt: skip
COULD_PACK = "_ZN2at6native7cpublas10could_packEN3c1010ScalarTypeE"
SCALAR_BF16 = 15  # c10::ScalarType::BFloat16


class NativeAttention:
    """The loaded kernel. Call it as `attend` is called, on the pool itself instead of a gather."""

    def __init__(self, lib: Path, isa: Isa) -> None:
        self.isa, self.lib = isa, lib
        loaded = ctypes.CDLL(str(lib))
        self.vnni = _set_brgemm(loaded) if isa.name == "brgemm" else False  # tile products on AMX
        # an int4 pool's scores by integer dot products, the queries quantized to int8 per 32 (csrc/quant_rows.h)
        self.int8_queries = "avx512_vnni" in isa.needs
        self._fn = getattr(loaded, f"radixrt_paged_attention_{isa.name}")
        self._fn.restype = ctypes.c_int
        p, i = ctypes.c_void_p, ctypes.c_int
        f, i64 = ctypes.c_float, ctypes.c_int64
        self._fn.argtypes = [p, p, p, i, p, p, p, i64, p, p, i, i, i, i, i, f, i64, f, p, p]
        self._layer = getattr(loaded, f"radixrt_attend_layer_{isa.name}")  # csrc/attend_layer.h
        self._layer.restype = ctypes.c_int
        self._layer.argtypes = [p, i, i64, p, i64, p, i64, p, i64, p, p, i, p, i64, p, p, i, i, i, i, i, f, i64, f, p]

    def __call__(
        self,
        q: torch.Tensor,
        k_pool: torch.Tensor,
        v_pool: torch.Tensor,
        pages: torch.Tensor,
        kv_lens: torch.Tensor,
        scale: float,
        want_lse: bool = False,
        window: int | None = None,
        softcap: float | None = None,
        q_starts: torch.Tensor | None = None,
        scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q: [T, heads, D] float32 query rows; k_pool, v_pool: [pages, page_size, kv_heads, D] float32
        or bf16; pages: [B, P] int64 page ids from each request's first; kv_lens: [B] int64 tokens of
        each request, its new ones included; q_starts: [B + 1] int64, request b's queries are rows
        q_starts[b] .. q_starts[b + 1] - 1 of q, its last tokens, each attending causally up to
        itself (None: one query per request, T == B: decode)
        -> out [T, heads, D] float32, and lse [T, heads] float32 when want_lse (else None).
        window: a query reads only the last `window` tokens up to itself; softcap: scores capped by
        softcap * tanh(score / softcap) (see LayerAttention). An int4 pool (uint8, [pages, page_size, kv_heads,
        D / 2]) comes with its scales: (K's, V's), [pages, page_size, kv_heads, D / 32] float16 each; an int8
        pool with [pages, page_size, kv_heads] float32 ones."""
        T, H, D = q.shape
        B = kv_lens.shape[0]
        _, page_size, kv_heads, _ = k_pool.shape
        if q_starts is None:
            assert T == B, "without q_starts, one query per request"
            q_starts = torch.arange(B + 1, dtype=torch.int64)
        k_scales, v_scales = scales if scales is not None else (None, None)
        for t in (q, k_pool, v_pool, pages, kv_lens, q_starts, *(scales or ())):
            assert t.is_contiguous() and t.device.type == "cpu"
        assert q.dtype == torch.float32 and pages.dtype == kv_lens.dtype == q_starts.dtype == torch.int64
        out = torch.empty_like(q)
        lse = torch.empty(T, H, dtype=torch.float32) if want_lse else None
        err = self._fn(
            q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), KINDS[k_pool.dtype],
            k_scales.data_ptr() if k_scales is not None else None, v_scales.data_ptr() if v_scales is not None else None,
            pages.data_ptr(), pages.shape[1],
            kv_lens.data_ptr(), q_starts.data_ptr(), B, H, kv_heads, D, page_size, scale, window or 0, softcap or 0.0,
            out.data_ptr(), lse.data_ptr() if lse is not None else None,
        )
        if err:
            raise RuntimeError(f"paged attention kernel ({self.isa.name}) failed: {ERRORS.get(err, err)}")
        return out, lse


class LayerStep:
    """One step's attention for the layers of one plan through the kernel's layer entry
    (csrc/attend_layer.h): the new K/V stored into a float32 or bf16 pool and every request
    attending, in one call per layer, the queries and the output in the model's dtype. The step's
    page tables, lengths, q_starts and slots are bound once; `__call__` returns None for inputs
    the entry does not take (another dtype, a head's features not contiguous): the caller's
    general path serves them."""

    def __init__(self, kernel: NativeAttention, pages: torch.Tensor, lens: torch.Tensor, q_starts: torch.Tensor | None,
                 slots: torch.Tensor, window: int | None) -> None:
        for t in (pages, lens, slots, *(() if q_starts is None else (q_starts,))):
            assert t.is_contiguous() and t.dtype == torch.int64 and t.device.type == "cpu"
        self.keep = (pages, lens, q_starts, slots)  # the pointers below stay valid while the step runs
        self.fn = kernel._layer
        self.step_args = (slots.data_ptr(), slots.shape[0])
        self.run_args = (pages.data_ptr(), pages.shape[1], lens.data_ptr(),
                         None if q_starts is None else q_starts.data_ptr(), lens.shape[0])
        self.window = window or 0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 scale: float, softcap: float | None) -> torch.Tensor | None:
        """q [T, heads, D], k and v [T, kv_heads, D] of one dtype -> [T, heads, D] in it, or None."""
        kind = LAYER_KINDS.get(q.dtype)
        T, H, D = q.shape
        if kind is None or k.dtype != q.dtype or v.dtype != q.dtype or not _heads_contiguous(q, k, v, D):
            return None
        out = torch.empty(T, H, D, dtype=q.dtype)
        err = self.fn(q.data_ptr(), kind, q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), *self.step_args,
                      k_pool.data_ptr(), v_pool.data_ptr(), KINDS[k_pool.dtype], *self.run_args, H, k.shape[1], D,
                      k_pool.shape[1], scale, self.window, softcap or 0.0, out.data_ptr())
        if err:
            raise RuntimeError(f"paged attention layer entry failed: {ERRORS.get(err, err)}")
        return out


LAYER_KINDS = {torch.float32: 0, torch.bfloat16: 1}  # the layer entry's queries, new K/V and output


def _heads_contiguous(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, D: int) -> bool:
    return (q.stride(2) == k.stride(2) == v.stride(2) == 1 and q.stride(1) == k.stride(1) == v.stride(1) == D
            and k.shape[2] == D and q.device.type == "cpu")


def _set_brgemm(loaded: ctypes.CDLL) -> bool:
    """Hands the brgemm variant torch's brgemm functions; returns whether B is packed for AMX tiles
    (torch's could_pack: a CPU with amx_bf16). Raises RuntimeError where this torch lacks them."""
    torch_cpu = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    try:
        gemm, pack, release = (ctypes.cast(getattr(torch_cpu, name), ctypes.c_void_p) for name in BRGEMM_SYMBOLS)
        could_pack = getattr(torch_cpu, COULD_PACK)
    except AttributeError as e:
        raise RuntimeError(f"torch {torch.__version__} does not export at::native::cpublas::brgemm ({e})") from e
    could_pack.argtypes, could_pack.restype = [ctypes.c_int8], ctypes.c_bool
    vnni = bool(could_pack(SCALAR_BF16))
    if vnni and hasattr(torch._C._cpu, "_init_amx"):
        torch._C._cpu._init_amx()  # asks Linux for the AMX tile state, once per process
    set_brgemm = loaded.radixrt_set_brgemm
    set_brgemm.argtypes, set_brgemm.restype = [ctypes.c_void_p] * 3 + [ctypes.c_int], None
    set_brgemm(gemm, pack, release, int(vnni))
    return vnni


@functools.cache
def build_variant(isa: Isa) -> NativeAttention:
    """The kernel built for `isa` (whether or not this CPU can run it: callers check). Raises
    RuntimeError (OSError from the loader) saying why it cannot be had."""
    return NativeAttention(build(SOURCE, isa), isa)

"""The compiled passes around a w8a8 int8 GEMM on CPU: per-token quantization of the activations
and the rescaling of the int32 sums (csrc/int8_ops.c), held bit for bit to the torch reference
(radixrt/models/int8_linear.py). In torch each is a handful of ops over the whole tensor; at a
decode step those ops cost twice the int8 GEMM itself (33 + 12 us against 16 us for one
[1, 576] x [576, 1728] layer on a 2-core EPYC), one pass each costs about a microsecond.

Built and chosen like fused_layers.py (native_build.py: one object per ISA, loaded through
ctypes); `load_int8_ops` gives None, logged with the reason, where they cannot be built, and
the layers keep the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from radixrt.kernels import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "int8_ops.c"
KINDS = {torch.float32: 0, torch.bfloat16: 1}


class Int8Ops:
    def __init__(self, lib: Path, isa: native_build.Isa) -> None:
        self.isa = isa
        so = ctypes.CDLL(str(lib))
        p, i, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
        self._quantize = self._entry(so, "quantize_tokens", [p, i64, i64, i64, i, p, p, i])
        self._rescale = self._entry(so, "rescale", [p, i64, i64, p, p, p, i, p, i, i])

    def _entry(self, so: ctypes.CDLL, name: str, argtypes: list) -> ctypes._CFuncPtr:
        fn = getattr(so, f"radixrt_{name}_{self.isa.name}")
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
        return fn

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """x: [T, K] CPU activations of a kind the kernels read, each row contiguous."""
        return x.is_cpu and x.dtype in KINDS and x.dim() == 2 and x.stride(1) == 1

    def quantize_tokens(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, K] -> (int8 [T, K], float32 scales [T, 1]), as int8_linear.quantize_rows."""
        T, K = x.shape
        q = torch.empty(T, K, dtype=torch.int8)
        scales = torch.empty(T, 1, dtype=torch.float32)
        err = self._quantize(x.data_ptr(), T, K, x.stride(0), KINDS[x.dtype], q.data_ptr(), scales.data_ptr(),
                             torch.get_num_threads())
        _check(err, "quantize_tokens")
        return q, scales

    def rescale(self, acc: torch.Tensor, sx: torch.Tensor, sw: torch.Tensor, bias: torch.Tensor | None,
                dtype: torch.dtype) -> torch.Tensor:
        """acc int32 [T, N] contiguous, sx float32 [T, 1], sw float32 [N, 1] -> y [T, N] of dtype."""
        T, N = acc.shape
        acc, sw = acc.contiguous(), sw.contiguous()
        if bias is not None and bias.dtype not in KINDS:
            bias = bias.float()
        out = torch.empty(T, N, dtype=dtype)
        err = self._rescale(acc.data_ptr(), T, N, sx.data_ptr(), sw.data_ptr(),
                            None if bias is None else bias.contiguous().data_ptr(),
                            KINDS[bias.dtype] if bias is not None else 0, out.data_ptr(), KINDS[dtype],
                            torch.get_num_threads())  # fmt: skip
        _check(err, "rescale")
        return out


def _check(err: int, kernel: str) -> None:
    if err:
        raise RuntimeError(f"int8 {kernel} kernel failed: an unknown dtype (code {err})")


def build_int8_ops(isa: native_build.Isa) -> Int8Ops:
    """One variant's kernels, built if the cache lacks them. Raises RuntimeError or OSError saying why."""
    return Int8Ops(native_build.build(SOURCE, isa), isa)


@functools.cache
def load_int8_ops() -> Int8Ops | None:
    """The kernels for this CPU (native_build.chosen_isa), built if needed; None (logged once, with
    the reason) where they cannot be built: the torch path stays."""
    try:
        ops = build_int8_ops(native_build.chosen_isa())
    except (OSError, RuntimeError, ValueError) as e:
        logger.warning("int8 ops: the compiled CPU kernels are unavailable (%s); using the torch path", e)
        return None
    logger.info("int8 ops: compiled CPU kernels loaded (%s)", ops.isa.name)
    return ops

"""Int8 linear layers: the quantized arithmetic, the kernels that compute it, and the choice among them.

A quantized layer holds `weight` as int8 [out, in] and `weight_scale` as float32 [out, 1]: row o
of the real weight is weight[o] * weight_scale[o] (symmetric, per output channel). Two schemes:

  w8a8_int8  each token's activations are quantized on the fly the same way (per-token dynamic
             symmetric int8: s_t = amax_t / 127, x_q = round(x / s_t), ties to even), the int8
             GEMM accumulates in int32 (exact), and y = acc * s_t * s_o (+ bias), rounded once
             to the activations' dtype. (SGLang's w8a8_int8, torchao's int8dq.)
  int8wo     the activations stay in the model's dtype: y = (x @ weight^T) * s_o (+ bias).
             (torchao's int8_weight_only, SGLang's --torchao-config int8wo.)

Kernels (Int8Kernel) compute a scheme; the reference of each (reference_w8a8, reference_int8wo)
does the same quantized arithmetic in float64, and tests hold every kernel to it:
  * w8a8 "int_mm": torch._int_mm (oneDNN's s8s8 GEMM: AVX512-VNNI or AMX-INT8 where the CPU
    has them, AVX2's vpmaddubsw otherwise; cuBLAS on CUDA), with the quantization of x and the
    rescaling done by the compiled kernels of radixrt/kernels/int8_ops.py where they load.
  * w8a8 "dequantized": float32 GEMM over weights dequantized once (x still quantized per
    token): the same numbers up to float32 accumulation, for a host whose int8 GEMM is slow.
  * int8wo "int8pack_mm": torch's _weight_int8pack_mm (what torchao runs on CPU).
  * int8wo "upcast": the int8 weight converted to the activations' dtype per call, then a GEMM;
    "float32": the same in float32, for half activations on a CPU without half GEMM units.
choose_int8_kernel times the candidates of a scheme on this host (in rotation, one thread, as
cpu_matmul.measure_matmul) at a decode step's rows and at a batch's, and keeps the fastest of
each (int8pack_mm wins a bf16 decode step on a 2-core EPYC and loses a batch of 64 by 3x), naming
the CPU's int8 units in its reason.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixrt.kernels.int8_ops import load_int8_ops
from radixrt.kernels.native_build import cpu_flags

logger = logging.getLogger(__name__)

QMAX = 127.0
INT8_UNITS = ("amx_int8", "avx512_vnni", "avx_vnni")  # CPU flags of int8 dot-product units
# The kernels are timed at a decode step's rows and at a batch's (a call of up to SPLIT_ROWS rows runs
# the first's winner, a larger one the second's), over a square and a wide layer (in, out).
PROBE_ROWS = (1, 64)
SPLIT_ROWS = 16
PROBE_LAYERS = ((1024, 1024), (1024, 4096))
PROBE_ROUNDS = 7  # timed rounds; each round runs every candidate once
W8A8, INT8WO = "w8a8_int8", "int8wo"


def quantize_rows(w: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 of w [rows, cols]: (int8 [rows, cols], float32 scales [rows, 1]),
    scale = amax / 127 in float32 (amax: each row's max |w|, or the one given: a row split over
    ranks quantizes by the whole row's); an all-zero row gets scale 1."""
    w = w.float()
    if amax is None:
        amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / QMAX, torch.ones_like(amax))
    return torch.round(w / scale).clamp_(-QMAX, QMAX).to(torch.int8), scale


def quantize_tokens_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token dynamic int8 of x [T, in] as the kernels do it (float32 arithmetic)."""
    return quantize_rows(x)


def reference_w8a8(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """w8a8_int8's arithmetic in float64 (activations quantized as the kernels do), rounded to x's dtype."""
    xq, sx = quantize_tokens_ref(x)
    y = (xq.double() @ q.double().T) * sx.double() * scale.double().view(1, -1)
    return (y if bias is None else y + bias.double()).to(x.dtype)


def reference_int8wo(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """int8wo's arithmetic in float64, rounded to x's dtype."""
    y = (x.double() @ q.double().T) * scale.double().view(1, -1)
    return (y if bias is None else y + bias.double()).to(x.dtype)


Int8Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, "torch.Tensor | None"], torch.Tensor]


def w8a8_int_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [T, in] -> y [T, out] through an int32-accumulating int8 GEMM."""
    ops = load_int8_ops() if x.is_cpu else None
    if ops is not None and ops.takes(x):
        xq, sx = ops.quantize_tokens(x)
    else:
        xq, sx = quantize_tokens_ref(x)
    if x.is_cuda and xq.shape[0] <= 16:  # cuBLAS's int8 GEMM wants more than 16 rows (untested here)
        xq = F.pad(xq, (0, 0, 0, 17 - xq.shape[0]))
    acc = torch._int_mm(xq, q.t())[: x.shape[0]]
    if ops is not None and ops.takes(x):
        return ops.rescale(acc, sx, scale, bias, x.dtype)
    y = acc.float().mul_(sx).mul_(scale.view(1, -1))
    return (y if bias is None else y.add_(bias.float())).to(x.dtype)


def dequantized_w8a8(held: torch.Tensor) -> Int8Kernel:
    """w8a8 through a float32 GEMM over `held`, the weights dequantized once [out, in]."""

    def run(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        xq, sx = quantize_tokens_ref(x)
        y = F.linear(xq.float(), held).mul_(sx)
        return (y if bias is None else y.add_(bias.float())).to(x.dtype)

    return run


def int8wo_pack_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    lead = x.shape[:-1]
    y = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, x.shape[-1]), q, scale.view(-1).to(x.dtype))
    y = y.view(*lead, -1)
    return y if bias is None else y + bias.to(y.dtype)


def int8wo_upcast(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = F.linear(x, q.to(x.dtype)) * scale.view(1, -1).to(x.dtype)
    return y if bias is None else y + bias.to(y.dtype)


def int8wo_float32(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """As int8wo_upcast in float32, rounded once: for half activations on a CPU without half GEMM units."""
    y = F.linear(x.float(), q.float()).mul_(scale.view(1, -1))
    return (y if bias is None else y.add_(bias.float())).to(x.dtype)


@dataclass(frozen=True)
class Int8Choice:
    scheme: str  # W8A8 or INT8WO
    kernel: str  # a key of CANDIDATES[scheme]: for calls of up to SPLIT_ROWS rows (decode steps)
    reason: str  # why, for the log and /get_server_info
    large: str = ""  # the kernel for calls of more rows (prefill chunks, big batches); "": the same


KERNELS: dict[str, Int8Kernel] = {"int_mm": w8a8_int_mm, "int8pack_mm": int8wo_pack_mm, "upcast": int8wo_upcast,
                                  "float32": int8wo_float32}
CANDIDATES: dict[str, tuple[str, ...]] = {W8A8: ("int_mm", "dequantized"),
                                          INT8WO: ("int8pack_mm", "upcast", "float32")}


def kernel_for(choice: Int8Choice, q: torch.Tensor, scale: torch.Tensor) -> Int8Kernel:
    """The callable that multiplies one layer (q, scale) by the chosen kernel(s)."""
    small = _kernel(choice.kernel, q, scale)
    if not choice.large or choice.large == choice.kernel:
        return small
    large = _kernel(choice.large, q, scale)

    def by_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return (small if x.shape[0] <= SPLIT_ROWS else large)(x, q, scale, bias)

    return by_rows


def _kernel(name: str, q: torch.Tensor, scale: torch.Tensor) -> Int8Kernel:
    return dequantized_w8a8(q.float() * scale) if name == "dequantized" else KERNELS[name]


def choose_int8_kernel(scheme: str, dtype: torch.dtype, device: torch.device) -> Int8Choice:
    """The fastest of the scheme's kernels for dtype activations on this host, for small calls and
    for large ones (see the module docstring)."""
    if device.type != "cpu":  # cuBLAS's int8 GEMM for w8a8; int8pack_mm is a CPU kernel (untested here)
        name = "int_mm" if scheme == W8A8 else "upcast"
        return Int8Choice(scheme, name, f"{device.type}: {name} (untested on {device.type})")
    units = [f for f in INT8_UNITS if f in (cpu_flags() or ())]
    names = [n for n in CANDIDATES[scheme] if not (n == "float32" and dtype == torch.float32)]  # upcast is that
    picks, measured = [], []
    for rows in PROBE_ROWS:
        times = _measure(scheme, names, dtype, rows)
        ranked = sorted(names, key=times.__getitem__)
        picks.append(ranked[0])
        measured.append(f"{rows} rows: " + ", ".join(f"{n} {times[n] / times[ranked[0]]:.2f}x" for n in ranked))
    return Int8Choice(scheme, picks[0], f"CPU int8 units: {'/'.join(units) or 'none (no VNNI or AMX)'}; measured "
                      f"{'; '.join(measured)} ({str(dtype).removeprefix('torch.')} activations)", large=picks[1])


def _measure(scheme: str, names: list[str], dtype: torch.dtype, rows: int) -> dict[str, float]:
    """Each kernel's median seconds over PROBE_LAYERS at `rows` rows, timed in rotation on one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as cpu_matmul.measure_matmul: under load a per-core ratio holds
    total = dict.fromkeys(names, 0.0)
    try:
        for k, n in PROBE_LAYERS:
            x = torch.randn(rows, k).to(dtype)
            q, scale = quantize_rows(torch.randn(n, k))
            calls = {c: functools.partial(_kernel(c, q, scale), x, q, scale, None) for c in names}
            seconds: dict[str, list[float]] = {c: [] for c in names}
            for i in range(PROBE_ROUNDS + 1):
                for c in names[i % len(names):] + names[: i % len(names)]:  # each goes first in turn
                    t = _seconds(calls[c])
                    if i:  # the first round: kernel selection and allocation, not timed
                        seconds[c].append(t)
            for c in names:
                total[c] += statistics.median(seconds[c])
    finally:
        torch.set_num_threads(threads)
    return total


def _seconds(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return max(time.perf_counter() - start, 1e-9)

"""Which dtype a half-precision model's matmuls run in on a CPU, chosen by measurement.

A CPU without half-precision GEMM units (AVX2, or AVX-512 without BF16/AMX)
runs torch's bf16/fp16 matmul through conversions that make it several times
slower than float32 at the same shape (measured 4-10x on a 2-core AVX2 EPYC).
There the linear layers hold float32 copies of the checkpoint's half weights
(exact: every half value is a float32 value) and compute in float32, while their
inputs and outputs stay in the model's dtype (ColumnParallelLinear,
RowParallelLinear). Each layer then rounds where a half GEMM does, once at its
output after float32 accumulation, so the model is still the half model; only
the summation order differs, as between any two GEMM kernels. The price is
twice the weights' memory, which a CPU has; the KV pool keeps the model's dtype.

The choice is a measurement, not a CPU-flag table: the same check picks half
matmuls on a CPU whose half GEMM is the faster one.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.models.parallel import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)

# Float32 must win by this much to be worth doubling the weights' memory.
MIN_SPEEDUP = 1.25
PROBE_ROWS, PROBE_FEATURES = 64, 1024  # a decode batch through a mid-sized projection


def _best_ms(fn, repeat: int = 3) -> float:
    fn()  # first call: kernel selection and allocation, not timed
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def measure_matmul(dtype: torch.dtype) -> tuple[float, float]:
    """(ms of one dtype matmul, ms of the same through float32 weights) at the probe shape, on CPU."""
    x = torch.randn(PROBE_ROWS, PROBE_FEATURES).to(dtype)
    w = torch.randn(PROBE_FEATURES, PROBE_FEATURES).to(dtype)  # [out, in]
    w32 = w.float()
    native = _best_ms(lambda: F.linear(x, w))
    upcast = _best_ms(lambda: F.linear(x.float(), w32).to(dtype))
    return native, upcast


def choose_matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the linear layers should hold their weights in (see the module docstring)."""
    if device.type != "cpu" or dtype == torch.float32:
        return dtype
    native, upcast = measure_matmul(dtype)
    if native < MIN_SPEEDUP * upcast:
        return dtype
    logger.info(
        "%s matmul on this CPU takes %.2f ms where float32 takes %.2f ms (no native %s GEMM): "
        "linear layers compute in float32 on the exact %s weights, rounding outputs to %s",
        dtype, native, upcast, dtype, dtype, dtype,
    )
    return torch.float32


def hold_linear_weights_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every linear layer its weight (and bias) in dtype. A weight tied to another
    module (the LM head to the embedding) gets its own copy; the other keeps its dtype."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.weight = nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
            if module.bias is not None:
                module.bias = nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)

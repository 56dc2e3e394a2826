"""How a model's linear layers multiply on a CPU: in which dtype (from the CPU's flags, confirmed by
measurement), and through which kernel (oneDNN on weights packed once, where torch's oneDNN packs them).

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

The choice (choose_matmul_dtype) starts from the CPU's capabilities: the flags of
half-precision GEMM units for the model's dtype (bf16: amx_bf16, avx512_bf16; fp16:
amx_fp16, avx512_fp16). A measurement only confirms it: the two candidates are timed
interleaved, pair by pair, and compared by each one's fastest timing, so a process that
starts beside this one slows both alike and cannot flip the choice (timed
one after the other, three bf16 matmuls once measured 7.6 ms against 0.13 ms alone, and
the model ran 1.7x slower). The measurement overrides the flags only when it disagrees
decisively (CONFIRM_FACTOR). --cpu-matmul-dtype model|float32 skips both.

Then the weights are packed (choose_weight_packing, pack_linear_weights): torch's own
F.linear hands a float32 GEMM to MKL and a bf16 one to oneDNN, which re-lays the weight
out on every call; a layer can instead hold its weight in oneDNN's blocked layout, made
once at start, and multiply through that (as vLLM's CPU linears and inductor's frozen
graphs do). On a 2-core AVX2 EPYC the decode linears ran 1.3-1.9x faster so (batch 16
and 64, tiny and small shapes) and a prefill chunk's no slower. Whether oneDNN packs the
dtype is a capability (torch built with it; bf16 needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT),
asked of oneDNN itself by packing a probe, not measured, so the choice cannot flip between
starts. The packed copy is a second copy of each linear's weight: the plain one still
serves the fingerprint, weight updates (which pack again) and the memory figures.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixrt.kernels.native_build import cpu_flags
from radixrt.models.parallel import ColumnParallelLinear, RowParallelLinear

logger = logging.getLogger(__name__)

# Float32 must win by this much to be worth doubling the weights' memory (the measurement alone).
MIN_SPEEDUP = 1.25
# The measurement overrides the CPU flags only when the other dtype is this much faster.
CONFIRM_FACTOR = 2.0
PROBE_ROWS, PROBE_FEATURES = 64, 1024  # a decode batch through a mid-sized projection
PROBE_PAIRS = 9  # interleaved (half, float32) timings; each one's fastest decides
HALF_GEMM_FLAGS = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}


@dataclass(frozen=True)
class MatmulChoice:
    dtype: torch.dtype  # what the linear layers hold their weights in and compute in
    reason: str  # why, for the log and /get_server_info


def measure_matmul(dtype: torch.dtype, pairs: int = PROBE_PAIRS) -> float:
    """How many times longer a dtype matmul takes than the same through float32 weights, at the
    probe shape on CPU: each one's fastest of `pairs` back-to-back timings, their order alternating."""
    x = torch.randn(PROBE_ROWS, PROBE_FEATURES).to(dtype)
    w = torch.randn(PROBE_FEATURES, PROBE_FEATURES).to(dtype)  # [out, in]
    w32 = w.float()
    native, upcast = (lambda: F.linear(x, w)), (lambda: F.linear(x.float(), w32).to(dtype))
    threads = torch.get_num_threads()
    # NOTE: one thread. A parallel GEMM whose thread is descheduled waits for it at its barrier,
    # so under load a kernel that runs on every thread slows more than one that runs on fewer,
    # and the ratio followed the load (fp16 against float32 once flipped so); per core it does not.
    torch.set_num_threads(1)
    try:
        native(), upcast()  # first calls: kernel selection and allocation, not timed
        times: dict = {native: [], upcast: []}
        for i in range(pairs):
            for fn in (native, upcast) if i % 2 == 0 else (upcast, native):
                times[fn].append(_seconds(fn))
    finally:
        torch.set_num_threads(threads)
    # NOTE: each candidate's fastest timing, not the median of the pairs' ratios: being
    # descheduled only adds time, and with a burner on each core more than half the pairs
    # could hold a preempted timing (fp16 at 0.83x float32 here once measured 1.25x so).
    return min(times[native]) / min(times[upcast])


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return max(time.perf_counter() - start, 1e-9)


def choose_matmul_dtype(dtype: torch.dtype, device: torch.device, setting: str = "auto",
                        use_flags: bool = True) -> MatmulChoice:
    """The dtype the linear layers should hold their weights in (see the module docstring).
    use_flags=False decides by the measurement alone (a test of its stability)."""
    if device.type != "cpu" or dtype == torch.float32:
        return MatmulChoice(dtype, f"{dtype} on {device.type}")
    if setting != "auto":
        return MatmulChoice(dtype if setting == "model" else torch.float32, f"--cpu-matmul-dtype {setting}")
    ratio = measure_matmul(dtype)  # half time / float32 time
    name = str(dtype).removeprefix("torch.")
    measured = f"{name} matmul measured {ratio:.2f}x the time of float32"
    flags = cpu_flags() if use_flags else None
    units = [f for f in HALF_GEMM_FLAGS.get(dtype, ()) if f in (flags or ())]
    if flags is None:  # no flags to read (or not asked to): the measurement alone
        return MatmulChoice(dtype if ratio < MIN_SPEEDUP else torch.float32, f"{measured} (no CPU flags read)")
    if units and ratio < CONFIRM_FACTOR:
        return MatmulChoice(dtype, f"CPU flags {'/'.join(units)}; {measured}")
    if not units and ratio > 1 / CONFIRM_FACTOR:
        return MatmulChoice(torch.float32, f"no {name} GEMM flags ({', '.join(HALF_GEMM_FLAGS.get(dtype, ()))}); "
                            f"{measured}")
    return MatmulChoice(dtype if ratio < 1 else torch.float32,
                        f"{measured}, which overrides the CPU flags ({'/'.join(units) or 'none'})")


@dataclass(frozen=True)
class PackingChoice:
    packed: bool  # whether the linear layers multiply through oneDNN-packed weights
    reason: str  # why, for the log and /get_server_info


def choose_weight_packing(dtype: torch.dtype, device: torch.device, setting: str = "auto") -> PackingChoice:
    """Whether the linear layers, holding weights of dtype, should multiply through oneDNN-packed
    copies (see the module docstring). setting: auto (wherever oneDNN packs dtype), onednn
    (required: a ValueError says why it cannot be had) or none."""
    if device.type != "cpu":
        return PackingChoice(False, f"{device.type}: the device's own GEMMs")
    if setting == "none":
        return PackingChoice(False, "--cpu-weight-packing none")
    name = str(dtype).removeprefix("torch.")
    why_not = _cannot_pack(dtype)
    if why_not is not None:
        if setting == "onednn":
            raise ValueError(f"--cpu-weight-packing onednn: oneDNN cannot pack {name} weights here: {why_not}")
        return PackingChoice(False, f"oneDNN cannot pack {name} weights here ({why_not}); torch's F.linear")
    if setting == "onednn":
        return PackingChoice(True, "--cpu-weight-packing onednn")
    return PackingChoice(True, f"oneDNN packs {name} weights on this CPU")


def _cannot_pack(dtype: torch.dtype) -> str | None:
    """Why oneDNN cannot pack and multiply dtype weights in this process, or None: asked of it
    by packing a probe weight and multiplying through it."""
    if not torch.backends.mkldnn.is_available():
        return "torch was built without oneDNN"
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype), None)
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), packed, None, "none", [], "")
    except RuntimeError as e:  # oneDNN's own words: the CPU lacks what the dtype needs
        return str(e).strip().splitlines()[0]
    return None


def pack_linear_weights(model: nn.Module) -> None:
    """Give every linear layer its weight packed for oneDNN (again after the weights change); int8
    layers multiply through their own kernels (weight_quant.py)."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.int8 is None and module.quant is None:
            module.packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)


def hold_linear_weights_in(model: nn.Module, dtype: torch.dtype) -> None:
    """Give every linear layer its weight (and bias) in dtype. A weight tied to another
    module (the LM head to the embedding) gets its own copy; the other keeps its dtype. int8
    layers (weight_quant.py) keep their int8 weights; a bias is the kernel's to read in any dtype."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight.dtype != torch.int8 \
                and module.quant is None:
            module.weight = nn.Parameter(module.weight.detach().to(dtype), requires_grad=False)
            if module.bias is not None:
                module.bias = nn.Parameter(module.bias.detach().to(dtype), requires_grad=False)

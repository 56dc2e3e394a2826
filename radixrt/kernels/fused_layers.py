"""A decoder layer's non-GEMM work: the torch references, and compiled CPU kernels held to them.

Three pieces sit between a layer's matmuls: RMSNorm (with the residual add before it),
rope, and act(gate) * up. In torch each is a handful of ops, and in bfloat16 every op
casts to float32 and back: at a batch-64 decode step the casts alone were more calls than
the matmuls. csrc/fused_layers.c does each piece in one pass over the rows, in float32,
rounding to bf16 exactly where these references round and summing the norm's squares in
torch's own order, so the model computes the same numbers: bit for bit for the norms and
rope (in float32 too), within one bf16 ulp (rarely off at all) for act * up, whose exp is
not torch's.

Two implementations of one small interface (`TorchLayers`): the references, and
`FusedLayers`, the compiled kernels for the activations they take (CPU tensors of `dtypes`;
act_mul only of `act_dtypes`), the references for everything else (CUDA, float16, unusual
strides). The model's modules hold one (`ops`) and call it; `load_fused_layers` gives the
kernels, or None, logged with the reason, where they cannot be built (the torch path stays).
RADIXRT_FUSED_LAYERS=0 keeps the torch path by choice. bench/fused_layers.py measured this
against torch.compile of the same references: see its docstring.

Plain C through ctypes, built by native_build.py (one object per ISA, chosen at run time),
as native_attention.py: no torch headers, about a second to build, a millisecond to load.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from radixrt.kernels import native_build

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "fused_layers.c"
ENABLE_ENV = "RADIXRT_FUSED_LAYERS"  # "0": the torch path
KINDS = {torch.float32: 0, torch.bfloat16: 1}  # activation dtype -> the kernels' `kind`
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_pytorch_tanh": functools.partial(F.gelu, approximate="tanh"),
}
ACT_CODES = {"silu": 0, "gelu_pytorch_tanh": 1}
# Where the model uses the kernels. The norms and rope compute torch's numbers bit for bit in both
# dtypes; act_mul's exp is not Sleef's, so its float32 results may differ in the last bit, and
# float32 is the exactness reference (token parity with transformers): it keeps torch's act_mul.
MODEL_DTYPES = frozenset({torch.bfloat16, torch.float32})
MODEL_ACT_DTYPES = frozenset({torch.bfloat16})
# A model whose linear layers are held quantized (a GGUF file's, int4wo) rounds every activation to int8 per
# 32 before it multiplies: act_mul's last bit is below that, and the kernel serves float32 too.
QUANTIZED_ACT_DTYPES = frozenset({torch.bfloat16, torch.float32})
MAX_NORM_HIDDEN = 1 << 16  # the kernel's limit (its scratch row is on the stack)


# ---- the references: what the model computes on the torch path ------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
    """x: [..., hidden] -> the same shape and dtype. Llama (as Hugging Face): normalize in float32,
    round to x's dtype, then scale by weight. Gemma: scale by (1 + weight) in float32, round once."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (xf * (1.0 + weight.float())).to(x.dtype)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x, residual: [T, hidden] -> (norm(residual + x), residual + x), the sum in x's dtype."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps, gemma), residual


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation (rotate_half) of x's last dim by cos, sin broadcast to it, in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rope_ref(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, heads, head_dim]; k: [T, kv_heads, head_dim]; cos, sin: [table_rows, rotary_dim] float32 (or
    the model's dtype, where model.to() rounded them); rows: [T] each token's table row -> (q, k)
    rotated on their first rotary_dim features."""
    # cos, sin: [T, 1, rotary_dim] in the activations' dtype, as Hugging Face applies them
    c, s = cos[rows].unsqueeze(1).to(q.dtype), sin[rows].unsqueeze(1).to(q.dtype)
    d = cos.shape[1]
    if d < q.shape[-1]:
        return (torch.cat([rotate(q[..., :d], c, s), q[..., d:]], dim=-1),
                torch.cat([rotate(k[..., :d], c, s), k[..., d:]], dim=-1))  # fmt: skip
    return rotate(q, c, s), rotate(k, c, s)


def act_mul_ref(gate_up: torch.Tensor, act: str) -> torch.Tensor:
    """gate_up: [T, 2 * inter] ([gate | up]) -> act(gate) * up [T, inter]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return ACTIVATIONS[act](gate) * up


class TorchLayers:
    """The layer ops on the torch path: the references. Contract of every implementation:
    add_rms_norm may overwrite x and residual (callers use what it returns and nothing else)."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
        return rms_norm_ref(x, weight, eps, gemma)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return add_rms_norm_ref(x, residual, weight, eps, gemma)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_ref(q, k, cos, sin, rows)

    def act_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        return act_mul_ref(gate_up, act)


TORCH_LAYERS = TorchLayers()  # stateless


def _rows(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """(outer, inner, outer stride, inner stride) of x's rows of x.shape[-1] contiguous features, for
    [T, hidden] and [T, heads, head_dim] views (a fused projection's slice); None for another layout."""
    s = x.stride()
    if len(s) == 2 and s[1] == 1:
        return x.shape[0], 1, s[0], 0
    if len(s) == 3 and s[2] == 1:
        return x.shape[0], x.shape[1], s[0], s[1]
    return None


class FusedLayers(TorchLayers):
    """The compiled kernels (one ISA's variant) for CPU activations of `dtypes`; the references for
    other inputs. NOTE: the checks before each call are the cheap ones (a call costs a few
    microseconds of Python, the kernel at batch 1 less than one): dtypes, devices, strides."""

    def __init__(
        self,
        lib: Path,
        isa: native_build.Isa,
        dtypes: frozenset[torch.dtype] = MODEL_DTYPES,
        act_dtypes: frozenset[torch.dtype] = MODEL_ACT_DTYPES,
    ) -> None:
        self.name, self.isa, self.dtypes, self.act_dtypes = f"fused-{isa.name}", isa, dtypes, act_dtypes
        so = ctypes.CDLL(str(lib))
        p, i, i64, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
        self._norm = self._entry(so, "rms_norm", [p, i64, i64, i64, i64, p, p, p, i, i64, f, i, i])
        self._rope = self._entry(so, "rope", [p, i64, p, i, p, i64, p, i, i, i64, i, i, p, p, i, i64, p, i])
        self._act = self._entry(so, "act_mul", [p, i64, p, i, i64, i64, i, i])

    def _entry(self, so: ctypes.CDLL, name: str, argtypes: list) -> Callable[..., int]:
        fn = getattr(so, f"radixrt_{name}_{self.isa.name}")
        fn.restype, fn.argtypes = ctypes.c_int, argtypes
        return fn

    def takes(self, x: torch.Tensor) -> bool:
        return x.dtype in self.dtypes and x.is_cpu

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False) -> torch.Tensor:
        rows = _rows(x) if self._takes_norm(x, weight) else None
        if rows is None:
            return rms_norm_ref(x, weight, eps, gemma)
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        err = self._norm(x.data_ptr(), *rows, None, out.data_ptr(), weight.data_ptr(), KINDS[x.dtype], x.shape[-1], eps,
                         gemma, torch.get_num_threads())  # fmt: skip
        _check(err, "rms_norm")
        return out

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x, then x = norm(residual): both in place."""
        if not (self._takes_norm(x, weight) and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous()
                and residual.dtype == x.dtype and residual.shape == x.shape):  # fmt: skip
            return add_rms_norm_ref(x, residual, weight, eps, gemma)
        T, hidden = x.shape
        err = self._norm(x.data_ptr(), T, 1, hidden, 0, residual.data_ptr(), x.data_ptr(), weight.data_ptr(),
                         KINDS[x.dtype], hidden, eps, gemma, torch.get_num_threads())  # fmt: skip
        _check(err, "add_rms_norm")
        return x, residual

    def _takes_norm(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        return (x.dtype in self.dtypes and x.is_cpu and weight.dtype == x.dtype and weight.is_contiguous()
                and x.shape[-1] <= MAX_NORM_HIDDEN)  # fmt: skip

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not (self._takes_heads(q, k) and self._takes_tables(cos, sin, rows)):
            return rope_ref(q, k, cos, sin, rows)
        T, heads, head_dim = q.shape
        q_out = torch.empty_like(q, memory_format=torch.contiguous_format)
        k_out = torch.empty_like(k, memory_format=torch.contiguous_format)
        err = self._rope(q.data_ptr(), q.stride(0), q_out.data_ptr(), heads, k.data_ptr(), k.stride(0), k_out.data_ptr(),
                         k.shape[1], KINDS[q.dtype], T, head_dim, cos.shape[1], cos.data_ptr(), sin.data_ptr(),
                         KINDS[cos.dtype], cos.shape[0], rows.data_ptr(), torch.get_num_threads())  # fmt: skip
        _check(err, "rope")
        return q_out, k_out

    def _takes_heads(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """q, k: [T, heads, head_dim] CPU views of one taken dtype, each head's features contiguous."""
        if not (q.dtype in self.dtypes and q.is_cpu and k.is_cpu and k.dtype == q.dtype and q.dim() == k.dim() == 3):
            return False
        (qs, ks), d = (q.stride(), k.stride()), q.shape[2]
        return qs[2] == ks[2] == 1 and qs[1] == ks[1] == d == k.shape[2] and q.shape[0] == k.shape[0]

    @staticmethod
    def _takes_tables(cos: torch.Tensor, sin: torch.Tensor, rows: torch.Tensor) -> bool:
        return (cos.dtype in KINDS and sin.dtype == cos.dtype and rows.dtype == torch.int64 and cos.is_cpu
                and rows.is_cpu and cos.is_contiguous() and sin.is_contiguous() and rows.is_contiguous()
                and sin.shape == cos.shape)  # fmt: skip

    def act_mul(self, gate_up: torch.Tensor, act: str) -> torch.Tensor:
        if not (gate_up.dtype in self.act_dtypes and gate_up.is_cpu and gate_up.dim() == 2 and gate_up.stride(1) == 1):
            return act_mul_ref(gate_up, act)
        T, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = gate_up.new_empty(T, inter)
        err = self._act(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), KINDS[gate_up.dtype], T, inter,
                        ACT_CODES[act], torch.get_num_threads())  # fmt: skip
        _check(err, "act_mul")
        return out


def _check(err: int, kernel: str) -> None:
    if err:
        why = {1: "an unknown dtype or activation", 2: "a bad rotary_dim", 3: "a rope table row out of range",
               4: "a row too long"}  # fmt: skip
        raise RuntimeError(f"fused {kernel} kernel failed: {why.get(err, f'code {err}')}")


def build_fused_layers(
    isa: native_build.Isa,
    dtypes: frozenset[torch.dtype] = MODEL_DTYPES,
    act_dtypes: frozenset[torch.dtype] = MODEL_ACT_DTYPES,
) -> FusedLayers:
    """One variant's kernels, built if the cache lacks them. Raises RuntimeError or OSError saying why."""
    return FusedLayers(native_build.build(SOURCE, isa), isa, dtypes, act_dtypes)


@functools.cache
def load_fused_layers(act_dtypes: frozenset[torch.dtype] = MODEL_ACT_DTYPES) -> FusedLayers | None:
    """The kernels for this CPU (native_build.chosen_isa), built if needed, act_mul's for act_dtypes; None
    where they are switched off or cannot be built (logged once, with the reason: the torch path stays)."""
    if os.environ.get(ENABLE_ENV, "1").strip() == "0":
        logger.info("fused layers: off (%s=0); using the torch path", ENABLE_ENV)
        return None
    try:
        fused = build_fused_layers(native_build.chosen_isa(), act_dtypes=act_dtypes)
    except (OSError, RuntimeError, ValueError) as e:
        logger.warning("fused layers: the compiled CPU kernels are unavailable (%s); using the torch path", e)
        return None
    logger.info("fused layers: compiled CPU kernels loaded (%s)", fused.isa.name)
    return fused

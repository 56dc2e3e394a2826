"""Which attention paths a test can run here: the compiled kernel's variants this CPU executes,
forcing one of them, and where a backend runs, in which dtype, to what tolerance."""

from __future__ import annotations

import pytest
import torch
from radixrt.kernels import native_attention
from radixrt.kernels.native_build import ISA_BY_NAME, ISA_ENV, ISAS, build, cpu_flags, find_compiler, runnable_isas


def require_native() -> None:
    """Every variant of the compiled kernel must build wherever there is a C compiler (the AVX-512
    one on an AVX2-only machine too: explicit flags, not -march=native); without one, say so and skip."""
    if find_compiler() is None:
        pytest.skip("no C compiler on this machine: the compiled attention kernel cannot be built")
    for isa in ISAS:
        build(native_attention.SOURCE, isa)  # raises, failing the test, if the compiler cannot build it


AMX = "amx_bf16" in (cpu_flags() or ())
# The compiled kernel's variants this CPU can execute, best first: each one runs every native case,
# and the test ids say which ran here (native-avx512, native-avx2, native-scalar). native-amx is the
# brgemm variant on AMX tiles: on a CPU without amx_bf16 its cases skip and say so, and brgemm runs
# as native-brgemm (torch's GEMM under the same products); with it, brgemm runs as native-amx only.
NATIVE = [f"native-{isa.name}" for isa in runnable_isas() if not (AMX and isa.name == "brgemm")]
NATIVE += ["native-amx"] if len(ISAS) > 1 else []


def use_path(path: str, monkeypatch) -> bool:
    """Whether a backend built now decodes through the compiled kernel; native-<isa> forces that variant."""
    if not path.startswith("native"):
        return False
    require_native()
    if path == "native-amx":
        if not AMX:
            pytest.skip("the AMX path needs a CPU with amx_bf16; this one lacks it (brgemm runs as native-brgemm)")
        assert native_attention.build_variant(ISA_BY_NAME["brgemm"]).vnni, "amx_bf16, yet torch's brgemm does not pack for tiles"
    monkeypatch.setenv(ISA_ENV, variant_of(path))
    return True


def int8_query_groups(q: torch.Tensor) -> torch.Tensor:
    """q [..., D] as a variant with int8_queries reads it for an int4 pool's scores: each 32 elements
    quantized to int8 against their largest magnitude / 127 (in float32, as the kernel rounds), read back."""
    x = q.float().unflatten(-1, (-1, 32))
    amax = x.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / amax, torch.zeros_like(amax))  # not 127.0 / amax: torch takes that as 127 * (1 / amax)
    return ((x * inv).round().clamp(-127, 127) * (amax / 127.0)).flatten(-2)


def attention_tolerance(dtype: torch.dtype, backend, kv_dtype: str) -> float:
    """A TorchBackend's output against float64 attention over the K/V its pool holds: float32 to 1e-5, bf16 to
    1e-2; over an int4 pool, a variant that quantizes the queries to int8 per 32 for its integer scores (a step
    of 1/254 of a group's largest: an output moves by up to ~1e-2 on random rows) to 3e-2, and
    test_int4_scores_* holds those scores to 1e-5 against the queries as the variant reads them."""
    if kv_dtype == "int4" and backend.kernels is not None and backend.kernels.decode.int8_queries:
        return 3e-2
    return 1e-5 if dtype == torch.float32 else 1e-2


def variant_of(path: str) -> str:
    """The kernel variant a native path runs (native-amx: brgemm)."""
    variant = path.removeprefix("native-")
    return "brgemm" if variant == "amx" else variant


def backend_device(name: str) -> tuple[torch.device, torch.dtype, float]:
    """Where a backend runs, in which dtype, to what tolerance; skips (saying why) when it cannot run here."""
    if name == "torch":
        return torch.device("cpu"), torch.float32, 1e-5
    if not torch.cuda.is_available():
        pytest.skip("the flashinfer backend needs a CUDA GPU; none is present")
    pytest.importorskip("flashinfer", reason="flashinfer-python (the `cuda` extra) is not installed")
    return torch.device("cuda"), torch.bfloat16, 2e-2

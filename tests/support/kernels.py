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
    variant = path.removeprefix("native-")
    if variant == "amx":
        if not AMX:
            pytest.skip("the AMX path needs a CPU with amx_bf16; this one lacks it (brgemm runs as native-brgemm)")
        assert native_attention.build_variant(ISA_BY_NAME["brgemm"]).vnni, "amx_bf16, yet torch's brgemm does not pack for tiles"
        variant = "brgemm"
    monkeypatch.setenv(ISA_ENV, variant)
    return True


def backend_device(name: str) -> tuple[torch.device, torch.dtype, float]:
    """Where a backend runs, in which dtype, to what tolerance; skips (saying why) when it cannot run here."""
    if name == "torch":
        return torch.device("cpu"), torch.float32, 1e-5
    if not torch.cuda.is_available():
        pytest.skip("the flashinfer backend needs a CUDA GPU; none is present")
    pytest.importorskip("flashinfer", reason="flashinfer-python (the `cuda` extra) is not installed")
    return torch.device("cuda"), torch.bfloat16, 2e-2

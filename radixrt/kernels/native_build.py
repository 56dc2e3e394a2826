"""Building the CPU kernels of csrc/: one C source, one shared object per instruction set,
the variant chosen at run time from what the CPU can execute.

Each source is compiled once per ISA with that ISA's `-m` flags and `-DRADIXRT_ISA_<NAME>`,
never `-march=native`: a machine with AVX2 only still builds the AVX-512 variant (it just
cannot run it), and a cached object does not depend on the machine that built it. The
source picks its vector code with `#if` on those macros and suffixes its entry points with
the ISA's name (`radixrt_paged_attention_avx512`), so the variants of one source differ
only in their flags; csrc/simd.h is the vector layer they share.

The variant a process runs is the best one the CPU's flags allow (ISAS, best first), or
the one `RADIXRT_CPU_KERNEL_ISA` names (avx512bf16, brgemm, avx512, avx2, scalar); naming one the CPU cannot
execute is an error, not a quiet downgrade. Objects are cached under
~/.cache/radixrt/kernels, keyed by the source, the headers beside it, the compiler and its flags; building one
takes about a second, loading a cached one a millisecond.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ISA_ENV = "RADIXRT_CPU_KERNEL_ISA"
BASE_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=c11", "-fno-math-errno")


@dataclass(frozen=True)
class Isa:
    """One build variant: the CPU flags it needs to run, and the compiler flags it is built with."""

    name: str
    needs: frozenset[str]  # /proc/cpuinfo flags every one of which the CPU must have
    cflags: tuple[str, ...]
    lanes: int  # float32 lanes of its vectors (a kernel's head_dim must be a multiple of this)


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")
# Best first. The scalar variant is plain C for any target (the compiler may still vectorize it).
# brgemm is avx512bf16's code with the attention kernel's many-row tasks as tile products through
# torch's oneDNN micro-kernel (csrc/brgemm_tiles.h; AMX tiles where the CPU has them): only a
# measurement (kernel_choice.py) or RADIXRT_CPU_KERNEL_ISA puts it before avx512bf16.
_AVX512 = frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"})
_AVX512_FLAGS = ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma")
# the bf16 dot product, and VNNI's int8 one (every CPU with the first has the second: Cooper Lake on, Zen 4 on)
_BF16, _BF16_FLAGS = frozenset({"avx512_bf16", "avx512_vnni"}), ("-mavx512bf16", "-mavx512vnni")
ISAS: tuple[Isa, ...] = (
    Isa("avx512bf16", _AVX512 | _BF16, (*_AVX512_FLAGS, *_BF16_FLAGS), 16),
    Isa("brgemm", _AVX512 | _BF16, (*_AVX512_FLAGS, *_BF16_FLAGS), 16),  # attention only: see below
    Isa("avx512", _AVX512, _AVX512_FLAGS, 16),
    Isa("avx2", frozenset({"avx2", "fma"}), ("-mavx2", "-mfma"), 8),
    Isa("scalar", frozenset(), (), 1),
) if _X86 else (Isa("scalar", frozenset(), (), 1),)  # fmt: skip
ISA_BY_NAME = {isa.name: isa for isa in ISAS}
# avx512bf16's code with AMX-INT8 tiles, for csrc/qgemm.c only (simd.h's RADIXRT_ISA_AMX): never a process's
# variant, so not in ISAS; quant_weights.py builds it beside the chosen one where the CPU has the tiles.
AMX = Isa("amx", _AVX512 | _BF16 | {"amx_tile", "amx_int8", "amx_bf16"},
          (*_AVX512_FLAGS, *_BF16_FLAGS, "-mamx-tile", "-mamx-int8", "-mamx-bf16"), 16)


def _cpuinfo_value(key: str, cpuinfo: Path) -> str | None:
    """The value of the first `key` line of /proc/cpuinfo, or None where there is none to read."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The x86 CPU's feature flags (the first "flags" line), or None where there is none to read."""
    value = _cpuinfo_value("flags", cpuinfo)
    return None if value is None else frozenset(value.split())


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name (the first "model name" line), or "" where there is none to read."""
    return _cpuinfo_value("model name", cpuinfo) or ""


def runnable_isas(flags: frozenset[str] | None = None) -> list[Isa]:
    """The variants this CPU can execute, best first (scalar always)."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa in ISAS if isa.needs <= (flags or frozenset())]


def chosen_isa(head_dim: int | None = None) -> Isa:
    """The variant to run: RADIXRT_CPU_KERNEL_ISA's, else the best runnable one whose vectors
    divide head_dim. Raises ValueError for a forced name that is unknown, cannot run here, or
    whose vectors do not divide head_dim: asked for, not quietly replaced."""
    runnable = runnable_isas()
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if forced:
        if forced not in ISA_BY_NAME:
            raise ValueError(f"{ISA_ENV}={forced!r}: not a kernel variant (choose from {', '.join(ISA_BY_NAME)})")
        isa = ISA_BY_NAME[forced]
        if isa not in runnable:
            raise ValueError(f"{ISA_ENV}={forced}: this CPU lacks {', '.join(sorted(isa.needs - (cpu_flags() or set())))}")
        if head_dim is not None and head_dim % isa.lanes:
            raise ValueError(f"{ISA_ENV}={forced}: its kernels need head_dim a multiple of {isa.lanes}, not {head_dim}")
        return isa
    return next(isa for isa in runnable if head_dim is None or head_dim % isa.lanes == 0)


def find_compiler() -> str | None:
    """The C compiler to build with: $CC, else `cc`, else `gcc` on PATH; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "radixrt" / "kernels"


@functools.cache
def _compiler_version(cc: str) -> str:
    done = subprocess.run([cc, "--version"], check=False, capture_output=True, text=True)
    return done.stdout.splitlines()[0] if done.returncode == 0 and done.stdout else cc


def build(source: Path, isa: Isa, out_dir: Path | None = None) -> Path:
    """The compiled variant's path, building it when the cache lacks it. Raises RuntimeError saying why."""
    cc = find_compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    flags = [*BASE_FLAGS, *isa.cflags, f"-DRADIXRT_ISA_{isa.name.upper()}"]
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what the source may include
    key = hashlib.sha256(source.read_bytes() + headers + " ".join([_compiler_version(cc), *flags]).encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"{source.stem}-{isa.name}-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *flags, str(source), "-o", tmp, "-lm"], check=False, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {source.name} for {isa.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, lib)  # atomic: ranks building at once each install a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib

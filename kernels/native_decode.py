"""The compiled CPU decode-attention kernel (csrc/decode_attention.c): build, load, call.

Built on first use with the machine's C compiler (`$CC`, else `cc`, `gcc`), for this
CPU (-march=native: AVX-512 where it has it) and with OpenMP, into a cache folder keyed
by the source, the flags and the CPU, so a later process loads it in a millisecond.
Plain C through ctypes, not a torch extension: no torch headers to compile (a build
takes about a second) and nothing for the user to install. Where it cannot build, the
caller keeps the torch path (decode_attention.py) and the log says why, once.

It serves pools of float32 and bfloat16; quantized pools (int8, fp8) and float16 take
the torch path, which dequantizes them.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "decode_attention.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
KINDS = {torch.float32: 0, torch.bfloat16: 1}  # pool dtype -> the kernel's `kind`


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "radixrt" / "kernels"


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({ln for ln in lines if ln.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor()


def find_compiler() -> str | None:
    """The C compiler to build with: $CC, else `cc`, else `gcc` on PATH; None without one."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(out_dir: Path | None = None) -> Path:
    """The compiled library's path, building it when the cache lacks it. Raises RuntimeError saying why."""
    cc = find_compiler()
    if cc is None:
        raise RuntimeError("no C compiler (set CC, or install gcc)")
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([cc, *FLAGS]).encode() + _cpu_id().encode()).hexdigest()[:16]
    out_dir = out_dir or cache_dir()
    lib = out_dir / f"decode_attention-{key}.so"
    if lib.exists():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-500:]}")
        os.replace(tmp, lib)  # atomic: ranks building at once each install a whole file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


class NativeDecode:
    """The loaded kernel. Call it as `attend` is called, on the pool itself instead of a gather."""

    def __init__(self, lib: Path) -> None:
        self._fn = ctypes.CDLL(str(lib)).radixrt_decode_attention
        self._fn.restype = ctypes.c_int
        p, i = ctypes.c_void_p, ctypes.c_int
        f, i64 = ctypes.c_float, ctypes.c_int64
        self._fn.argtypes = [p, p, p, i, p, i64, p, i, i, i, i, i, f, i64, f, p, p]

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
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """q: [B, heads, D] float32; k_pool, v_pool: [pages, page_size, kv_heads, D] float32 or bf16;
        pages: [B, P] int64 page ids from each request's first; kv_lens: [B] int64 (>= 1)
        -> out [B, heads, D] float32, and lse [B, heads] float32 when want_lse (else None).
        window: each request reads only its last `window` tokens; softcap: scores capped by
        softcap * tanh(score / softcap) (see LayerAttention)."""
        B, H, D = q.shape
        _, page_size, kv_heads, _ = k_pool.shape
        for t in (q, k_pool, v_pool, pages, kv_lens):
            assert t.is_contiguous() and t.device.type == "cpu"
        assert q.dtype == torch.float32 and pages.dtype == kv_lens.dtype == torch.int64
        out = torch.empty_like(q)
        lse = torch.empty(B, H, dtype=torch.float32) if want_lse else None
        err = self._fn(
            q.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), KINDS[k_pool.dtype], pages.data_ptr(),
            pages.shape[1], kv_lens.data_ptr(), B, H, kv_heads, D, page_size, scale, window or 0, softcap or 0.0,
            out.data_ptr(), lse.data_ptr() if lse is not None else None,
        )
        if err:
            raise RuntimeError(f"decode attention kernel failed with code {err}")
        return out, lse


@functools.cache
def load_native_decode() -> NativeDecode | None:
    """The kernel, built if needed; None (logged once, with the reason) where it cannot be."""
    try:
        kernel = NativeDecode(build())
    except (OSError, RuntimeError) as e:
        logger.warning("CPU decode attention: the compiled kernel is unavailable (%s); using the torch path", e)
        return None
    logger.info("CPU decode attention: compiled kernel loaded")
    return kernel

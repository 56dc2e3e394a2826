"""Which compiled attention variant serves each shape class: measured at start, cached, or forced.

TorchBackend calls the kernel (native_attention.py) in three shapes, the classes here:
  decode   one query row per request over its own pages (decodes, a cascade's tails)
  extend   prefill chunks: many causal rows per request over a cached prefix (decodes among them)
  cascade  one prefix read for many rows: a cascade's shared prefix, a draft tree's cached prefix
What is fastest differs by class and by host: the variant the CPU's flags rank best is not
always the fastest (a bf16 dot product pays on an EPYC's prefill chunks and can lose on
another host's decodes), so each class runs the fastest variant of those this CPU executes,
timed on a probe of the model's own shape (KV heads, GQA group, head_dim, page size, pool
dtype) when the worker starts. The candidates run in a new seeded order each round (a fixed
order lets one find the pool in the last-level cache that the one before it warmed) and each
class takes the lowest median; the variant the flags rank best keeps a class unless another
is at least MARGIN faster there, so noise alone never flips it. Before any timing each
variant's output on the probes must agree with the scalar variant's (plain C, which the tests
hold to float64 attention on every host): one that disagrees is dropped and logged, never run.

The result is cached under native_build.cache_dir() by the CPU (model name and flags), the
variants' builds (source, headers, compiler, flags: their file names), the shape and the
thread count: a later start with the same key reads it instead of measuring. The choice and
its reason are logged and reach /get_server_info (attention_kernels). RADIXRT_CPU_KERNEL_ISA
forces one variant for every class, unmeasured.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from radixrt.kernels.kv_quant import KV_FORMATS, KVFormat, element_bytes
from radixrt.kernels.native_attention import NativeAttention, build_variant
from radixrt.kernels.native_build import ISA_ENV, Isa, cache_dir, chosen_isa, cpu_flags, cpu_model, runnable_isas

logger = logging.getLogger(__name__)

CLASSES = ("decode", "extend", "cascade")
MARGIN = 0.05  # a variant displaces the flags' best for a class when it measures at least this much faster
ROUNDS = 7  # timed calls per variant and class (medians), after one untimed call each
# the probes: decode requests of DECODE_LEN tokens, as many as hold DECODE_BYTES of K and V: a
# server's decodes read their KV from memory, not from a cache (a probe of 16 x 256 tokens that
# stayed in L3 chose avx512bf16 for page size 1, where out of cache it took 1.37x avx512's time);
# extend requests x (cached, new) tokens; cascade members x prefix tokens
DECODE_LEN, DECODE_BYTES = 512, 64 << 20
EXTEND, CASCADE = (2, 256, 64), (16, 512)
CHOICE_FORMAT = 2  # bump when the probes or the rule change: older cached choices are then not read


@dataclass(frozen=True)
class Shape:
    """What the kernel runs over in this process: query heads and the pool's geometry and dtype."""

    heads: int
    kv_heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype  # the pool's storage (uint8: int4, packed; int8)


@dataclass(frozen=True)
class KernelChoice:
    """The kernel each class runs, and why (for the log and /get_server_info)."""

    decode: NativeAttention
    extend: NativeAttention
    cascade: NativeAttention
    reason: str

    def names(self) -> dict[str, str]:
        """class -> the variant's name."""
        return {c: getattr(self, c).isa.name for c in CLASSES}


class Probe:
    """One call per class over a pool of random K/V on shuffled pages, in the shape's dtype."""

    def __init__(self, s: Shape, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.scale = s.head_dim**-0.5
        # the quantized pools (kv_quant.py): packed int4 (two values a byte, a float16 scale per group), int8
        int4, int8 = s.dtype == torch.uint8, s.dtype == torch.int8
        fmt = KV_FORMATS["int4"] if int4 else KV_FORMATS["int8"] if int8 else KVFormat(s.dtype, False)
        token_bytes = 2 * s.kv_heads * element_bytes(fmt, s.head_dim, s.dtype)  # K and V
        decodes = max(8, DECODE_BYTES // (DECODE_LEN * token_bytes))
        lens = {"decode": [DECODE_LEN] * decodes, "extend": [EXTEND[1] + EXTEND[2]] * EXTEND[0], "cascade": [CASCADE[1]]}
        widths = {c: -(-max(n) // s.page_size) for c, n in lens.items()}
        num_pages = sum(len(n) * widths[c] for c, n in lens.items())
        order = torch.randperm(num_pages, generator=g)
        shape = (num_pages, s.page_size, s.kv_heads, s.head_dim)
        self.scales = None
        if int4:
            self.k, self.v = (torch.randint(0, 256, (*shape[:3], s.head_dim // 2), generator=g, dtype=torch.uint8) for _ in range(2))
            self.scales = tuple((torch.rand(*shape[:3], s.head_dim // fmt.group, generator=g) / 4).half() for _ in range(2))
        elif int8:
            self.k, self.v = (torch.randint(-127, 128, shape, generator=g, dtype=torch.int8) for _ in range(2))
            self.scales = tuple(torch.rand(*shape[:3], generator=g) / 64 for _ in range(2))
        else:
            self.k, self.v = (torch.randn(shape, generator=g).to(s.dtype) for _ in range(2))
        # q rows per class: decode [requests, heads, D]; extend [requests * new, heads, D] with q_starts;
        # cascade [1, members * heads, D], the members' rows of a KV head as its group (as _grouped_prefixes calls)
        q_shapes = {"decode": (decodes, s.heads), "extend": (EXTEND[0] * EXTEND[2], s.heads), "cascade": (1, CASCADE[0] * s.heads)}
        self.args: dict[str, tuple] = {}
        at = 0
        for c, n in lens.items():
            pages = order[at : at + len(n) * widths[c]].view(len(n), widths[c]).contiguous()
            at += pages.numel()
            q = torch.randn(*q_shapes[c], s.head_dim, generator=g)
            q_starts = torch.arange(0, EXTEND[0] * EXTEND[2] + 1, EXTEND[2]) if c == "extend" else None
            self.args[c] = (q, pages, torch.tensor(n, dtype=torch.int64), q_starts)

    def run(self, kernel: NativeAttention, cls: str) -> torch.Tensor:
        q, pages, lens, q_starts = self.args[cls]
        return kernel(q, self.k, self.v, pages, lens, self.scale, q_starts=q_starts, scales=self.scales)[0]


def choose_kernels(shape: Shape) -> KernelChoice | None:
    """The kernel of each class for this shape (see the module docstring), built if needed; None
    (logged, with the reason) where no variant builds. A forced variant that cannot serve raises
    ValueError (native_build.chosen_isa)."""
    if os.environ.get(ISA_ENV, "").strip():
        isa = chosen_isa(shape.head_dim)
        kernel = _built([isa]).get(isa.name)
        if kernel is None:
            return None
        return _choice({c: kernel for c in CLASSES}, f"{ISA_ENV}={isa.name}")
    kernels = _built([isa for isa in runnable_isas() if shape.head_dim % isa.lanes == 0])
    if not kernels:
        return None
    if len(kernels) == 1:
        (kernel,) = kernels.values()
        return _choice({c: kernel for c in CLASSES}, f"{kernel.isa.name}: the only variant that builds and runs here")
    path = cache_dir() / f"attention-choice-{_key(shape, kernels)}.json"
    cached = _read(path, kernels)
    if cached is not None:
        names, ms = cached
        return _choice({c: kernels[names[c]] for c in CLASSES}, f"measured at an earlier start ({path.name}): {_summary(names, ms)}")
    names, ms, dropped = measure(kernels, shape)
    _write(path, names, ms)
    why = f"measured at start: {_summary(names, ms)}"
    return _choice({c: kernels[names[c]] for c in CLASSES}, why + "".join(f"; {d} dropped: {e}" for d, e in dropped.items()))


def measure(kernels: dict[str, NativeAttention], shape: Shape) -> tuple[dict[str, str], dict[str, dict[str, float]], dict[str, str]]:
    """kernels: name -> kernel, the flags' best first. Returns each class's choice, every agreeing
    timed variant's median ms per class (every one but the scalar reference, where
    there are others), and the variants dropped for disagreeing with the scalar one (why)."""
    probe = Probe(shape)
    agreeing, dropped = dict(kernels), {}
    if "scalar" in kernels:
        tol = 1e-4 if shape.dtype == torch.float32 else 2e-2
        for c in CLASSES:
            want = probe.run(kernels["scalar"], c)
            for name in [n for n in agreeing if n != "scalar"]:
                err = (probe.run(agreeing[name], c) - want).abs().max().item()
                if not err <= tol:  # NaN too
                    dropped[name] = f"its {c} output differs from the scalar variant's by {err:.3g}"
                    logger.error("CPU attention: variant %s %s; it is not used", name, dropped[name])
                    del agreeing[name]
    timed = {n: k for n, k in agreeing.items() if n != "scalar"} or agreeing  # plain C: the reference, ~10x slower
    ms = {c: median_ms({n: (lambda k=k, c=c: probe.run(k, c)) for n, k in timed.items()}) for c in CLASSES}
    return {c: pick(t, next(iter(timed))) for c, t in ms.items()}, ms, dropped


def pick(ms: dict[str, float], first: str) -> str:
    """The fastest of ms (name -> median ms), unless it beats `first` (the flags' best) by less than MARGIN."""
    fastest = min(ms, key=ms.get)
    return fastest if ms[fastest] < ms[first] * (1 - MARGIN) else first


def median_ms(fns: dict, rounds: int = ROUNDS) -> dict[str, float]:
    """name -> the median ms of fns[name]() over `rounds` calls after one untimed call, the
    candidates in a new seeded order each round."""
    names, order = list(fns), random.Random(0)
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names:
        fns[n]()
    for _ in range(rounds):
        order.shuffle(names)
        for n in names:
            t = time.perf_counter()
            fns[n]()
            times[n].append(time.perf_counter() - t)
    return {n: statistics.median(ts) * 1e3 for n, ts in times.items()}


def _built(isas: list[Isa]) -> dict[str, NativeAttention]:
    """name -> kernel for each of isas that builds (in their order); the others logged."""
    out = {}
    for isa in isas:
        try:
            out[isa.name] = build_variant(isa)
        except (OSError, RuntimeError) as e:
            logger.warning("CPU attention: the compiled kernel's %s variant is unavailable (%s)", isa.name, e)
    if not out:
        logger.warning("CPU attention: no compiled kernel variant builds here; using the torch path")
    return out


def _choice(kernels: dict[str, NativeAttention], reason: str) -> KernelChoice:
    choice = KernelChoice(reason=reason, **kernels)
    logger.info("CPU attention kernels: %s (%s)", ", ".join(f"{c} {n}" for c, n in choice.names().items()), reason)
    return choice


def _summary(names: dict[str, str], ms: dict[str, dict[str, float]]) -> str:
    """'decode avx512 0.212 ms (avx512bf16 1.08x, avx2 1.31x), ...': each class's choice and the others' time ratios."""
    parts = []
    for c in CLASSES:
        others = ", ".join(f"{n} {t / ms[c][names[c]]:.2f}x" for n, t in ms[c].items() if n != names[c])
        parts.append(f"{c} {names[c]} {ms[c][names[c]]:.3f} ms ({others})")
    return "; ".join(parts)


def _key(shape: Shape, kernels: dict[str, NativeAttention]) -> str:
    """What a cached choice depends on, hashed: the CPU, the builds, the shape, the threads."""
    parts = [CHOICE_FORMAT, cpu_model(), sorted(cpu_flags() or ()), sorted(k.lib.name for k in kernels.values()),
             shape.heads, shape.kv_heads, shape.head_dim, shape.page_size, str(shape.dtype), torch.get_num_threads()]
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]


def _read(path: Path, kernels: dict[str, NativeAttention]) -> tuple[dict[str, str], dict[str, dict[str, float]]] | None:
    """A cached choice that names only variants at hand, else None (a missing or unreadable file is measured anew)."""
    try:
        data = json.loads(path.read_text())
        names, ms = data["choice"], data["ms"]
        if set(names) == set(CLASSES) and all(n in kernels for n in names.values()):
            return names, ms
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _write(path: Path, names: dict[str, str], ms: dict[str, dict[str, float]]) -> None:
    """Atomically: ranks measuring at once each install a whole file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w") as f:
            json.dump({"choice": names, "ms": ms}, f)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("CPU attention: could not cache the kernel choice in %s (%s)", path, e)

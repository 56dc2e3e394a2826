"""A linear layer's product through its weight held quantized (kernels/quant_weights.py), and which kernel
multiplies it at how many rows: the ISA's integer tiles (VNNI where the CPU has it) at few rows, and from
a row count start-up measures on the layer's shape, the AMX-INT8 tiles, the AMX-BF16 tiles over the weight
dequantized a tile at a time, or the weight dequantized for the call and multiplied by the model dtype's
GEMM, whichever is fastest there (tensor-parallel ranks then take
rank 0's: agree_routes). Also a tied embedding's lookup from the LM head's held weight.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixrt.kernels.quant_weights import FORMATS, QGemm, QuantWeight, held_rows

PROBE_ROWS = (16, 64, 256, 1024)  # row counts at which start-up times each way against the integer tiles
PROBE_ROUNDS = 5
MARGIN = 0.95  # another way is taken where it costs at most this share of the current one's time
# the ISA's integer tiles, the AMX-INT8 tiles, the weight dequantized per call, the AMX-BF16 tiles over the weight
# dequantized a tile at a time (QGemm.name of the kernels besides the ISA's tiles: tile_kernels())
WAYS = ("tiles", "amx", "dequantized", "amx-bf16")
WAY_NAMES = {"amx": "AMX-INT8", "amx-bf16": "AMX-BF16"}


@dataclass(frozen=True)
class Route:
    """From `rows` rows, the product goes through `kernel`'s tiles, or (kernel None) through the weight
    dequantized for the call and F.linear."""

    rows: int
    kernel: QGemm | None

    def __str__(self) -> str:
        return f"from {self.rows} rows {self.kernel.name + ' tiles' if self.kernel else 'dequantized per call'}"


class QuantLinear:
    """A layer's product through its held weight: x [.., K] -> x W^T [.., N] in x's dtype (float32 for any
    dtype but float32 and bf16)."""

    def __init__(self, weight: QuantWeight, kernel: QGemm, routes: Sequence[Route] = ()) -> None:
        """kernel: the tiles below the first route's rows; routes: by rows, ascending (choose_routes)."""
        self.weight, self.kernel, self.routes = weight, kernel, tuple(routes)
        self._tiles = kernel.bind(weight)  # below the first route: every decode step's product
        self._from = routes[0].rows if routes else 1 << 62
        self._routed = [(r.rows, r.kernel.bind(weight) if r.kernel is not None else None) for r in routes]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        K, N = self.weight.in_features, self.weight.out_features
        dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
        if x.dim() == 2 and x.shape[0] < self._from:  # a step's tokens [T, K], decode's case: no reshapes
            return self._tiles(x, dtype)
        rows = x.reshape(-1, K)
        product = self._tiles
        for start, routed in self._routed:
            if rows.shape[0] >= start and (routed is not None or dtype == x.dtype):
                product = routed
        y = F.linear(rows, self.kernel.dequantize(self.weight, dtype)) if product is None else product(rows, dtype)
        return y.view(*x.shape[:-1], N)


class QuantRows:
    """An embedding's lookup from a held weight (a tied LM head's): ids [T] -> rows [T, K] in dtype, each
    dequantized from the packed tiles as `dequantize` would."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype) -> None:
        self.weight, self.dtype = weight, dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return held_rows(self.weight, ids.reshape(-1)).to(self.dtype)


def choose_routes(weight: QuantWeight, kernel: QGemm, others: Sequence[QGemm], dtype: torch.dtype) -> tuple[list[Route], str]:
    """At each of PROBE_ROWS (median of PROBE_ROUNDS, on this layer's shape, x in dtype), the fastest of the
    current way, the other tiles (tile_kernels(): AMX-INT8, AMX-BF16) and dequantizing per call, another taken
    only where it costs at most MARGIN of the current one; the routes that makes, and the timings as ratios to kernel's tiles, for
    the log. Measured on an AMX Xeon (2 cores, SmolLM2's shapes): the AMX tiles 0.41-0.95x the VNNI ones' time
    at 16 rows, 0.26-0.7x at 64; dequantizing 1.5-3x bf16's F.linear alone."""
    ways: dict[str, tuple[QGemm | None, Callable]] = {kernel.isa.name: (kernel, lambda x: kernel(x, weight, dtype))}
    for other in others:
        ways[other.name] = (other, lambda x, other=other: other(x, weight, dtype))
    ways["dequantized"] = (None, lambda x: F.linear(x, kernel.dequantize(weight, dtype)))
    routes, current, timings = [], kernel.isa.name, []
    for rows in PROBE_ROWS:
        x = torch.randn(rows, weight.in_features).to(dtype)
        times = {name: _median_s(lambda fn=fn: fn(x)) for name, (_, fn) in ways.items()}
        timings.append(f"{rows} rows " + " ".join(f"{n} {t / times[kernel.isa.name]:.2f}x" for n, t in times.items()))
        best = min(times, key=times.get)
        if best != current and times[best] <= MARGIN * times[current]:
            routes.append(Route(rows, ways[best][0]))
            current = best
    return routes, "; ".join(timings)


def route_codes(routes: Sequence[Route]) -> list[int]:
    """The way each of PROBE_ROWS' row counts multiplies by under routes (WAYS' index): what ranks share."""
    codes, way = [], 0
    for rows in PROBE_ROWS:
        for r in routes:
            if r.rows == rows:
                way = WAYS.index("dequantized" if r.kernel is None else r.kernel.name if r.kernel.name in WAYS else "tiles")
        codes.append(way)
    return codes


def routes_from_codes(codes: Sequence[int], kernel: QGemm, others: Sequence[QGemm]) -> list[Route]:
    """route_codes' inverse on this process's kernels. Raises RuntimeError where a code names tiles this
    process has not (others: its tile_kernels())."""
    ways = {"tiles": kernel, "dequantized": None} | {o.name: o for o in others}
    for code in set(codes):
        if WAYS[code] not in ways:
            raise RuntimeError(f"another rank multiplies through the {WAY_NAMES[WAYS[code]]} tiles, which this process "
                               "cannot load")
    routes, current = [], 0
    for rows, code in zip(PROBE_ROWS, codes):
        if code != current:
            routes.append(Route(rows, ways[WAYS[code]]))
            current = code
    return routes


def agree_routes(model: torch.nn.Module, share: Callable[[list[int]], list[int]], others: Sequence[QGemm]) -> list[str]:
    """Route every held layer of `model` as rank 0 measured its format's (share: rank 0's ints on every rank,
    Ranks.share), so that tensor-parallel ranks multiply a layer's slices alike at every row count: each
    process measures its own at start. Returns the formats whose routes changed here."""
    held = [(m, m.quant) for m in model.modules() if isinstance(getattr(m, "quant", None), QuantLinear)]
    mine: dict[str, list[int]] = {}
    for _, q in held:
        mine.setdefault(q.weight.format.name, route_codes(q.routes))
    names = sorted(FORMATS)
    agreed = share([c for name in names for c in mine.get(name, [-1] * len(PROBE_ROWS))])
    theirs = {name: agreed[i * len(PROBE_ROWS):(i + 1) * len(PROBE_ROWS)] for i, name in enumerate(names)}
    changed = sorted(name for name in mine if theirs[name] != mine[name])
    for module, q in held:
        codes = theirs[q.weight.format.name]
        if -1 in codes:
            raise RuntimeError(f"rank 0 holds no {q.weight.format.name} layer where this rank does")
        if q.weight.format.name in changed:
            module.quant = QuantLinear(q.weight, q.kernel, routes_from_codes(codes, q.kernel, others))
    return changed


def _median_s(fn) -> float:
    fn()
    times = []
    for _ in range(PROBE_ROUNDS):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)

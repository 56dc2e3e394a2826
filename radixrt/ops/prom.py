"""Reading a server's /metrics: samples by name and labels, histogram percentiles, and the
metric names a scrape declares. `radixrt top`, bench/serving.py and the tests read /metrics
through here, so their percentiles are computed one way (Prometheus' histogram_quantile)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count", "_created")
COUNTER_SUFFIXES = ("_total", "_created")


@dataclass
class Scrape:
    """One /metrics text: samples keyed by (sample name, sorted label items), and each family's type."""

    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)  # family name -> counter | gauge | histogram | ...

    @classmethod
    def parse(cls, text: str) -> Scrape:
        s = cls()
        for fam in text_string_to_metric_families(text):
            s.types[fam.name] = fam.type
            for sample in fam.samples:
                s.samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return s

    def sample_names(self) -> set[str]:
        """Every name a PromQL expression may use against this scrape: each family's samples'
        names, whether or not a labelled family has samples yet (`_bucket`, `_total`, ...)."""
        names = {name for name, _ in self.samples}
        for fam, kind in self.types.items():
            suffixes = HISTOGRAM_SUFFIXES if kind == "histogram" else COUNTER_SUFFIXES if kind == "counter" else ()
            names |= {fam} | {fam + s for s in suffixes}
        return names

    def value(self, name: str, default: float | None = None, **labels: str) -> float:
        """The sum of name's samples whose labels include `labels` (default when there is none;
        without a default a missing metric raises KeyError)."""
        hits = [v for (n, lab), v in self.samples.items() if n == name and _has(lab, labels)]
        if not hits:
            if default is None:
                raise KeyError(f"{name}{labels or ''} is not in the scrape")
            return default
        return sum(hits)

    def buckets(self, name: str, **labels: str) -> list[tuple[float, float]]:
        """A histogram's cumulative (upper bound, count) pairs, summed over its other labels."""
        out: dict[float, float] = {}
        for (n, lab), v in self.samples.items():
            if n == name + "_bucket" and _has(lab, labels):
                le = float(dict(lab)["le"])
                out[le] = out.get(le, 0.0) + v
        return sorted(out.items())


def _has(have: tuple[tuple[str, str], ...], want: dict[str, str]) -> bool:
    d = dict(have)
    return all(d.get(k) == v for k, v in want.items())


def delta_buckets(after: list[tuple[float, float]], before: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Cumulative buckets of what was observed between two scrapes of the same histogram."""
    prior = dict(before)
    return [(le, count - prior.get(le, 0.0)) for le, count in after]


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets: linear
    interpolation inside the bucket holding the q-th observation, the first bucket starting at 0,
    and the largest finite bound when it falls in +Inf. NaN with no observations."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    rank, lower, below = q * buckets[-1][1], 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            return lower + (le - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = le, count
    return lower


def percentiles(buckets: list[tuple[float, float]], qs: tuple[float, ...] = (0.5, 0.95, 0.99)) -> dict[str, float]:
    """{"p50": ..., "p95": ..., "p99": ...} of one histogram."""
    return {f"p{round(q * 100)}": histogram_quantile(q, buckets) for q in qs}

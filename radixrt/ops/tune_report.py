"""The tuning results, shown: a table of every configuration, a JSON file and a PNG chart."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixrt.config import ServerArgs
from radixrt.ops.recommend import Recommendation
from radixrt.ops.replay import RunResult
from radixrt.ops.tune_metrics import Percentiles, Precision, Summary
from radixrt.ops.tune_plan import Point

PLOT_INSTALL_HINT = ("matplotlib is not installed: `pip install matplotlib` (or `pip install radixrt[dev]`) to get "
                     "the chart, or pass --no-plot")


@dataclass(frozen=True)
class Measured:
    """One configuration's run: the sweep points it stands for and what it measured."""

    label: str
    args: ServerArgs
    points: tuple[Point, ...]
    run: RunResult
    summary: Summary
    precision: Precision | None  # its greedy outputs against the fp (kv auto) run's; None for that run
    start_s: float  # seconds the engine took to start


def table(rows: list[Measured]) -> str:
    """A fixed-width table, one line per configuration (times in ms)."""
    head = (f"{'configuration':<24} {'TTFT ms p50/p95/p99':>21} {'TPOT ms p50/p95/p99':>21} {'tok/s':>7} "
            f"{'KV pool/used':>12} {'hit':>5} {'retr':>5} {'fail':>4} {'same as fp':>16}")
    lines = [head, "-" * len(head)]
    for m in rows:
        s = m.summary
        p = m.precision
        same = "reference" if p is None else f"{p.identical:.0%} lead {p.leading_match:.2f}"
        lines.append(f"{m.label:<24} {_ms3(s.ttft_s):>21} {_ms3(s.tpot_s):>21} {s.throughput:>7.1f} "
                     f"{f'{s.peak_pool:.0%}/{s.peak_used:.0%}':>12} {s.hit_rate:>5.0%} {s.retractions:>5} "
                     f"{s.failed:>4} {same:>16}")
    return "\n".join(lines)


def _ms3(p: Percentiles) -> str:
    return "/".join("-" if v is None else f"{v * 1000:.1f}" for v in (p.p50, p.p95, p.p99))


def write_json(path: Path, rows: list[Measured], rec: Recommendation, meta: dict[str, Any]) -> None:
    """Everything measured: meta (trace, settings), per configuration its overrides of the
    baseline, summary, precision and per-request timings, and the recommendation."""
    base = next(m.args for m in rows if m.label == "baseline")
    doc = {
        **meta,
        "baseline": dataclasses.asdict(base),
        "configurations": [_row_json(m, base) for m in rows],
        "recommendation": {
            "command": rec.command(base.model_path),
            "flags": rec.flags,
            "choices": [dataclasses.asdict(c) for c in rec.choices],
        },
    }
    path.write_text(json.dumps(doc, indent=2, default=str))


def _row_json(m: Measured, base: ServerArgs) -> dict[str, Any]:
    overrides = {f.name: getattr(m.args, f.name) for f in dataclasses.fields(ServerArgs)
                 if getattr(m.args, f.name) != getattr(base, f.name)}
    requests = [{"line": r.line, "ttft_s": r.ttft, "tpot_s": r.tpot, "prompt_tokens": r.prompt_tokens,
                 "cached_tokens": r.cached_tokens, "completion_tokens": r.completion_tokens, "error": r.error}
                for r in m.run.records]
    return {
        "label": m.label,
        "points": [{"variable": p.variable, "value": p.value} for p in m.points],
        "overrides": overrides,
        "engine_start_s": m.start_s,
        "wall_s": m.run.wall_s,
        "summary": dataclasses.asdict(m.summary),
        "precision_vs_fp": None if m.precision is None else dataclasses.asdict(m.precision),
        "requests": requests,
    }


def check_plotting() -> str | None:
    """None when matplotlib imports, else what to do about it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return PLOT_INSTALL_HINT
    return None


def plot(path: Path, rows: list[Measured], title: str) -> None:
    """Bars per configuration: TTFT p50 and p95 (ms) above, throughput (tok/s) below."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt

    labels = [m.label for m in rows]
    xs = range(len(rows))
    fig, (ax_ttft, ax_tput) = plt.subplots(2, 1, figsize=(max(7.0, 1.1 * len(rows)), 7), sharex=True)
    for offset, (name, get) in zip((-0.2, 0.2), (("p50", lambda p: p.p50), ("p95", lambda p: p.p95))):
        ax_ttft.bar([x + offset for x in xs], [(get(m.summary.ttft_s) or 0) * 1000 for m in rows], 0.4,
                    label=f"TTFT {name}")
    ax_ttft.set_ylabel("TTFT (ms)")
    ax_ttft.legend()
    ax_ttft.set_title(title)
    ax_tput.bar(list(xs), [m.summary.throughput for m in rows], 0.6, color="tab:green")
    ax_tput.set_ylabel("throughput (output tok/s)")
    ax_tput.set_xticks(list(xs), labels, rotation=30, ha="right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)

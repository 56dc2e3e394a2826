"""bench/speculative.py's chart: per model, output tok/s with and without speculation, their
ratio and the mean acceptance length, each against concurrency (log2 axis), one line per workload."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def plot(models: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(models), 3, figsize=(16, 4.2 * len(models)), squeeze=False)
    for row, (model, res) in zip(axes, models.items()):
        for i, (workload, by_b) in enumerate(res["rows"].items()):
            color = f"C{i}"
            bs = sorted(by_b, key=int)
            xs = [int(b) for b in bs]
            row[0].plot(xs, [by_b[b]["output_tok_s_off"] for b in bs], "o-", color=color, label=f"{workload} off")
            on = [by_b[b]["output_tok_s_on"] for b in bs]
            if any(v is not None for v in on):
                row[0].plot(xs, on, "s--", color=color, label=f"{workload} on")
            for ax, key in ((row[1], "ratio"), (row[2], "accept_length")):
                ys = [by_b[b][key] for b in bs]
                if any(v is not None for v in ys):
                    ax.plot(xs, ys, "o-", color=color, label=workload)
        row[0].set_yscale("log")
        row[0].set_ylabel("output tok/s")
        row[1].axhline(1.0, color="grey", lw=0.8)
        row[1].axhline(0.95, color="red", lw=0.8, ls=":")
        row[1].set_ylabel("tok/s with / without speculation")
        row[2].set_ylabel("completion tokens per verify step")
        note = " (no speculative run)" if res.get("spec_error") else ""
        for ax, title in zip(row, ("throughput", "speedup", "acceptance length")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrency (requests in flight)")
            ax.set_title(f"{model}: {title}" + (note if title != "throughput" else ""), fontsize=9)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)

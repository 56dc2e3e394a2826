"""Shared by the benchmarks: model paths, deterministic prompts, results on disk."""

from __future__ import annotations

import json
import platform
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "scripts"))

from make_tiny_model import ensure_model  # noqa: E402,F401


def random_prompts(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of lo..hi token ids below vocab, all different (no shared prefixes)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def write_result(name: str, data: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    data = dict(data, machine=platform.machine(), python=platform.python_version(), when=time.strftime("%Y-%m-%d %H:%M"))
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def save_model_result(name: str, model: str, result: dict[str, Any], plot: Callable[[dict, Path], None]) -> None:
    """Merge one model's result into bench/results/NAME.json (keeping the other models') and redraw NAME.png."""
    path = RESULTS / f"{name}.json"
    models = json.loads(path.read_text()).get("models", {}) if path.exists() else {}
    models[model] = result
    print("\nwrote", write_result(name, {"models": models}))
    plot(models, RESULTS / f"{name}.png")
    print("wrote", RESULTS / f"{name}.png")

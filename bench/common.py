"""Shared by the benchmarks: model paths, deterministic prompts, results on disk, a poller
of a server's figures while a run is in flight, and a step worker that clocks each forward."""

from __future__ import annotations

import json
import math
import platform
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "scripts"))

from make_tiny_model import ensure_model  # noqa: E402,F401


class TimedWorker:
    """A step worker (radixrt/scheduler/step.py) that clocks each forward of the one it wraps:
    steps holds (batch, seconds), the scheduler's own time left out."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.steps: list[tuple[Any, float]] = []

    def move(self, moves: list) -> None:
        self.worker.move(moves)

    def forward(self, batch: Any) -> Any:
        start = time.perf_counter()
        result = self.worker.forward(batch)  # .tolist() of the sampled ids waits for the device
        self.steps.append((batch, time.perf_counter() - start))
        return result


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


class Poller:
    """Reads `read()[key]` about every period_s seconds in a thread, from entering the `with` block
    to leaving it (and never past limit_s), keeping every number it read in `seen` (a missing or
    non-numeric value is skipped). Leaving the block waits for the read in progress."""

    def __init__(self, read: Callable[[], dict[str, Any]], key: str, period_s: float, limit_s: float = math.inf) -> None:
        self.read, self.key, self.period_s, self.limit_s = read, key, period_s, limit_s
        self.seen: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"poll-{key}", daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        deadline = time.monotonic() + self.limit_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            start = time.monotonic()
            value = self.read().get(self.key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                self.seen.append(value)
            self._stop.wait(max(0.0, self.period_s - (time.monotonic() - start)))

    @property
    def peak(self) -> float | None:
        return max(self.seen) if self.seen else None

    @property
    def samples(self) -> int:
        return len(self.seen)

    @property
    def busy_mean(self) -> float:
        """The mean of the nonzero readings (polls after the run ended read 0), 0.0 without any."""
        busy = [v for v in self.seen if v > 0]
        return statistics.mean(busy) if busy else 0.0


def save_model_result(name: str, model: str, result: dict[str, Any], plot: Callable[[dict, Path], None]) -> None:
    """Merge one model's result into bench/results/NAME.json (keeping the other models') and redraw NAME.png."""
    path = RESULTS / f"{name}.json"
    models = json.loads(path.read_text()).get("models", {}) if path.exists() else {}
    models[model] = result
    print("\nwrote", write_result(name, {"models": models}))
    plot(models, RESULTS / f"{name}.png")
    print("wrote", RESULTS / f"{name}.png")


class ClientTimes:
    """A request's latencies as its client saw them, from the record's `sent`, `first` (the first
    chunk with a token), `done` and `output_tokens`; TPOT is the mean gap after the first token."""

    @property
    def ttft(self) -> float:
        return self.first - self.sent

    @property
    def e2e(self) -> float:
        return self.done - self.sent

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None

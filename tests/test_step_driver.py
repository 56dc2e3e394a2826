"""One step driver (radixrt/scheduler/step.py) runs every scheduler, in the scheduler process,
the tests and the benches: nothing else calls a scheduler's schedule() or process(), or takes
the tier moves apart, so no caller can skip the moves a batch depends on."""

from __future__ import annotations

import ast
import random
from pathlib import Path

from support.fake_worker import FakeWorker
from radixrt.config import ServerArgs
from radixrt.config_views import SchedulerConfig
from radixrt.messages import KVMove, TokenizedRequest
from radixrt.sampling_params import SamplingParams
from radixrt.scheduler.scheduler import Scheduler
from radixrt.scheduler.step import drive

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("radixrt", "bench", "scripts", "examples", "tests")
DRIVER = "radixrt/scheduler/step.py"
# The scheduler's own unit tests look between schedule() and process(); the tier classes and
# their unit tests hand moves on inside the scheduler package, and bench/kv_tiers_sim.py replays
# KVMemory's bookkeeping alone (no scheduler, no batch) under an old version and this one.
MAY_STEP = {DRIVER, "tests/test_scheduler.py"}
MAY_TAKE_MOVES = {"radixrt/scheduler/scheduler.py", "radixrt/scheduler/tier_bridge.py", "tests/test_kv_tiers.py",
                  "tests/test_disk_tier_faults.py", "tests/test_tier_prefix_property.py", "bench/kv_tiers_sim.py",
                  "tests/test_kv_storage.py"}


def stepping_calls(source: str) -> list[tuple[int, str]]:
    """(line, name) of each call that runs a scheduler by hand: x.schedule(), x.process(...), x.take_moves()."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name = node.func.attr
            if (name == "schedule" and not node.args and not node.keywords) or name in ("process", "take_moves"):
                found.append((node.lineno, node.col_offset, name))
    return [(line, name) for line, _, name in sorted(found)]


def test_the_finder_sees_a_loop_written_out():
    loop = "while not s.idle:\n    b = s.schedule()\n    w.move(s.take_moves())\n    s.process(w.forward(b))\n"
    assert [name for _, name in stepping_calls(loop)] == ["schedule", "take_moves", "process"]


def test_only_the_driver_runs_a_scheduler_step_by_step():
    offenders = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, name in stepping_calls(path.read_text()):
                allowed = MAY_TAKE_MOVES if name == "take_moves" else MAY_STEP
                if rel not in allowed:
                    offenders.append(f"{rel}:{line} calls {name}(): use radixrt.scheduler.step")
    assert not offenders, "\n".join(offenders)


class RecordingWorker(FakeWorker):
    """Notes, in order, what the driver hands it."""

    def __init__(self, *a, **k) -> None:
        super().__init__(*a, **k)
        self.calls: list[str] = []

    def move(self, moves: list[KVMove]) -> None:
        self.calls += [f"move {m.kind.name}" for m in moves]
        super().move(moves)

    def forward(self, batch):
        self.calls.append("forward")
        return super().forward(batch)


def test_the_driver_makes_the_moves_before_the_batch_that_reads_them():
    rng = random.Random(8)
    w = RecordingWorker(24, 4, host_pages=48)
    args = ServerArgs(model_path="unused", page_size=4, schedule_policy="lpm", enable_hierarchical_cache=True,
                      max_running_requests=1)
    s = Scheduler(SchedulerConfig.of(args), w.ready, None)
    sp = SamplingParams(max_new_tokens=2, ignore_eos=True, temperature=0)
    doc = [rng.randrange(50) for _ in range(60)]
    for rid, prompt in [("doc", doc + [1])] + [(f"other{i}", [rng.randrange(50) for _ in range(60)]) for i in range(2)]:
        s.add_request(TokenizedRequest(rid, prompt, sp))  # the others evict doc's KV to the host tier
        drive(s, w)
    w.calls.clear()
    s.add_request(TokenizedRequest("hit", doc + [2, 3], sp))
    outputs = drive(s, w)
    assert [o.rid for o in outputs if o.finish is not None] == ["hit"]
    assert "move H2D" in w.calls and w.calls.index("move H2D") < w.calls.index("forward"), w.calls  # back first
    assert outputs[0].cached_tokens == 60

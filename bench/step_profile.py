"""Where one decode step's time goes: a sampling profile of the worker and the scheduler.

64 requests with short prompts decode 192 tokens each (greedy, ignore_eos), so nearly
every step is a batch-64 decode. py-spy samples both processes while they run; each
sample is put in the first bucket whose function appears in its stack:

  attention plan   TorchBackend.init_forward (page tables -> kernel arguments)
  attention        TorchBackend.forward (KV write, decode kernel)
  model            the rest of the forward: matmuls, norms, rope, logits
  batch prep       ModelRunner._prepare / _apply_slot_changes (per-step tensors)
  sampling         ModelRunner._sample (and logprobs)
  ipc              zmq and msgspec in the worker (Receiver.recv is idle time: not counted)
  scheduler        every active sample of the scheduler process

"Overhead" is everything but model and attention, as a share of the worker's busy time
plus the scheduler's (the two run one after the other on this 2-core machine).

    .venv/bin/python bench/step_profile.py [--model tiny|small|DIR] [--tag after]

Needs py-spy (`pip install py-spy`); writes bench/results/step_profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from common import RESULTS, write_result

PEER_MODELS = Path.home() / ".cache" / "radixrt-peers" / "models"
BATCH, PROMPT, NEW = 64, 32, 192
# (bucket, function names that put a sample in it), checked in order
WORKER_BUCKETS = [
    ("attention plan", ("TorchBackend.init_forward",)),
    ("attention", ("TorchBackend.forward",)),
    ("model", ("LlamaForCausalLM.forward", "LlamaForCausalLM.compute_logits")),
    ("batch prep", ("ModelRunner._prepare", "ModelRunner._apply_slot_changes")),
    ("sampling", ("ModelRunner._sample", "entry_logprobs")),
    ("ipc", ("Sender.send", "Receiver.recv")),
]


def bucket_samples(raw: Path, buckets) -> Counter:
    counts: Counter = Counter()
    for line in raw.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        names = [frame.split(" (")[0] for frame in stack.split(";")]
        if names and names[-1] in ("Socket.recv", "Poller.poll", "poll"):
            continue  # blocked waiting for the next message: idle
        for name, funcs in buckets:
            if any(f in names for f in funcs):
                counts[name] += int(n)
                break
        else:
            counts["other"] += int(n)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny", help="tiny | small (the peers' models) or a checkpoint directory")
    ap.add_argument("--tag", default="current", help="the name this run is stored under in the results")
    ap.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    a = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(spy):
        raise SystemExit("py-spy is not installed: pip install py-spy")
    model = str(PEER_MODELS / a.model) if (PEER_MODELS / a.model).is_dir() else a.model
    import radixrt

    rng = random.Random(0)
    prompts = [[rng.randrange(10, 4000) for _ in range(PROMPT)] for _ in range(BATCH)]
    sp = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
    with radixrt.Engine(model_path=model, dtype="bfloat16", page_size=16, max_running_requests=BATCH) as eng:
        eng.generate(input_ids=prompts[:2], sampling_params={"max_new_tokens": 4})  # warm up
        pids = {p.name: p.pid for p in eng._backend.processes}
        out = Path(tempfile.mkdtemp())
        spies = {
            role: subprocess.Popen([spy, "record", "-p", str(pids[name]), "-r", str(a.rate), "-f", "raw",
                                    "-o", str(out / f"{role}.txt"), "--nonblocking"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for role, name in (("worker", "radixrt-worker-0"), ("scheduler", "radixrt-scheduler"))
        }
        time.sleep(1.0)  # py-spy attaches
        start = time.perf_counter()
        eng.generate(input_ids=prompts, sampling_params=sp)
        wall = time.perf_counter() - start
        for p in spies.values():
            p.send_signal(2)
        for p in spies.values():
            p.wait()
    worker = bucket_samples(out / "worker.txt", WORKER_BUCKETS)
    scheduler = sum(bucket_samples(out / "scheduler.txt", []).values())
    total = sum(worker.values()) + scheduler
    shares = {k: v / total for k, v in worker.items()} | {"scheduler": scheduler / total}
    overhead = sum(v for k, v in shares.items() if k not in ("model", "attention"))
    step_ms = wall / NEW * 1e3
    print(f"{a.model}, batch {BATCH}: {step_ms:.1f} ms per decode step ({BATCH * NEW / wall:.0f} tok/s)")
    for k, v in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"  {k:15} {100 * v:5.1f}%  {v * step_ms:6.2f} ms")
    print(f"  overhead (not model, not attention): {100 * overhead:.1f}%")
    path = RESULTS / "step_profile.json"
    runs = json.loads(path.read_text()).get("runs", {}) if path.exists() else {}
    runs[f"{a.model}/{a.tag}"] = {"step_ms": step_ms, "shares": shares, "overhead": overhead, "batch": BATCH}
    print("wrote", write_result("step_profile", {"runs": runs}))


if __name__ == "__main__":
    main()

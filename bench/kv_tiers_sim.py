"""The KV tiers' page bookkeeping replayed on the multi-tenant trace: the prefix-order rule against the old LRU.

What issue 33's note asks: what prefix order in the lower tiers changed against the flat LRU tier
index they had before, on the same trace, in hit rate and in the bytes held by unreachable pages
(pages held in host memory or on disk whose earlier page is held nowhere: no request can read them).

No model and no worker process: each request of the trace, in order, goes through the scheduler's
own KVMemory + KVTiers (match, admit with loads from host/disk, grow, advance, release), and a fake
worker carries out the moves on a temp disk directory (a page file is created for each disk write
and removed for each drop: KVTiers checks that a disk page's file exists). Two code versions run in
the same invocation, each in its own subprocess with PYTHONPATH at its tree:
  old  the radixrt package of commit --old-commit (default 1fcce79, before issue 33: a flat LRU
       per lower tier), unpacked with `git archive` into a temp dir; its only behaviour is LRU and
       write-back;
  new  this checkout, for each --radix-eviction-policy (lru, lfu, cost) under write_back, and
       lru under write_through (SGLang's default).
One replay function serves both; it adapts to each version's constructors (the new ones take the
eviction order and the write policy). Requests run one at a time, with their tenant as cache salt
(as bench/kv_tiers.py sends them) and without pins (the old code has none).

Sizes, in pages of 16 tokens, from the trace's working set W (its distinct full prompt pages): the
device pool W/4 and host memory W/2 as in bench/kv_tiers.py, and three disk tiers:
  unbounded  2 W: never full. The old LRU then never drops a page (every page evicted from the
             device is kept somewhere), so nothing could become unreachable: a page only goes
             unreachable where a tier drops one;
  small      W/8 (--small-disk): device, host and disk together hold less than W, so the disk drops;
  none       no disk tier: host memory drops what it evicts (SGLang's HiCache without storage).

Per run:
- hit rate: cached prompt tokens / prompt tokens, cached = the tree's match (device, with the
  partial page it copies) + pages loaded from host or disk x 16, split by tier;
- unreachable pages by the same naive check for both versions, after every request: the parent of
  each page key comes from the trace's own token sequences (each version's page_keys, so the keys
  have that version's format); a key held in host or on disk is unreachable when a page of its
  chain back to the first is held nowhere (device: the keys of every full page of the device tree,
  from its token sequences). The max over the run and the final count, in pages (tier slots: a
  page held in host and on disk counts twice) and in bytes for two models' KV in bfloat16: the
  tiny llama the benches run (scripts/make_tiny_model.py) and SmolLM2-135M.
The table gives each run's hit rate as a ratio to old/lru in the same configuration. Writes
bench/results/kv_tiers_sim.json and bench/results/kv_tiers_sim.png. A few seconds a run.

    .venv/bin/python bench/kv_tiers_sim.py [--trace examples/data/tenant_trace.jsonl] [--old-commit 1fcce79]
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "examples" / "data" / "tenant_trace.jsonl"
PAGE = 16
OLD_COMMIT = "1fcce79"  # before issue 33: the lower tiers were a flat LRU over content keys
POLICIES = ("lru", "lfu", "cost")
SMALL_DISK = 0.125  # of the working set: device 1/4 + host 1/2 + disk 1/8 hold less than the trace's pages

# KV bytes per token in bfloat16: 2 (K and V) x layers x kv heads x head dim x 2 bytes.
MODELS = {
    "llama-tiny": (4, 2, 16),  # scripts/make_tiny_model.py _llama_tiny (the benches build it in float32: x2)
    "SmolLM2-135M": (30, 3, 64),  # HuggingFaceTB/SmolLM2-135M config.json
}


def page_bytes(model: str) -> int:
    layers, kv_heads, head_dim = MODELS[model]
    return PAGE * 2 * layers * kv_heads * head_dim * 2


@dataclass(frozen=True)
class Replay:
    """One run: which tree, its sizes (pages) and policies. Crosses into the replay subprocess as JSON."""

    name: str
    version: str  # "old" | "new"
    root: str  # the directory whose radixrt package runs
    trace: str
    device_pages: int
    host_pages: int
    disk_pages: int
    policy: str = "lru"
    write_policy: str = "write_back"


# -- the replay (runs in a subprocess, against one version's radixrt) ----------------------------------


class FakeWorker:
    """Carries out the moves' effect on the disk directory: a file per page written there, removed on a drop.
    The device and host contents are not modeled (no model runs)."""

    def __init__(self, disk: Path, move_kind: Any, disk_page_name: Any) -> None:
        self.disk, self.kind, self.name = disk, move_kind, disk_page_name

    def run(self, mem: Any) -> None:
        for m in mem.bridge.take_moves():
            if m.kind in (self.kind.H2DISK, self.kind.D2DISK):
                for key in m.keys:
                    (self.disk / self.name(key)).touch()
            elif m.kind is self.kind.DROP:
                for key in m.keys:
                    (self.disk / self.name(key)).unlink()
        mem.copies.take()


def device_keys(mem: Any, page_keys: Any) -> set[str]:
    """Keys of every full page the device tree holds, from its nodes' token sequences (parents first)."""
    known: dict[int, list[str]] = {}
    out: set[str] = set()
    for namespace, tokens, node in mem.cache.sequences():
        keys = known[id(node)] = page_keys(tokens, PAGE, namespace.encoded, known.get(id(node.parent)))
        out.update(keys)
    return out


def unreachable(mem: Any, parent_of: dict[str, str | None], on_device: set[str]) -> tuple[int, int]:
    """(host slots, disk slots) holding a page whose chain back to its sequence's first page has a page held nowhere."""
    t = mem.tiers
    host, disk = set(t.host.keys()), set(t.disk.keys()) if t.disk is not None else set()
    held = host | disk | on_device
    assert not (host | disk) - parent_of.keys(), "a tier holds a page of no prompt of the trace"
    ok: dict[str, bool] = {}

    def reachable(key: str) -> bool:
        path = []
        while key not in ok:
            path.append(key)
            parent = parent_of[key]
            if parent is None:
                good = True
                break
            if parent not in held:
                good = False
                break
            key = parent
        else:
            good = ok[key]
        for k in path:
            ok[k] = good
        return good

    return sum(not reachable(k) for k in host), sum(not reachable(k) for k in disk)


def build(run: Replay, disk_dir: str) -> tuple[Any, Any]:
    """This version's KVMemory and KVTiers at run's sizes ("" disk_dir: no disk tier). The new
    constructors take the eviction order and the write policy; the old ones have neither."""
    from radixrt.scheduler.kv_memory import KVMemory
    from radixrt.scheduler.kv_tiers import KVTiers

    if "order" not in inspect.signature(KVTiers.__init__).parameters:
        assert (run.policy, run.write_policy) == ("lru", "write_back"), "the old tiers are LRU and write-back only"
        tiers = KVTiers(run.host_pages, True, disk_dir, run.disk_pages)
        return KVMemory(run.device_pages, PAGE, True, tiers), tiers
    from radixrt.cache.eviction import EvictionOrder

    order = EvictionOrder(run.policy)
    tiers = KVTiers(run.host_pages, True, disk_dir, run.disk_pages, page_size=PAGE, order=order,
                    write_policy=run.write_policy)
    return KVMemory(run.device_pages, PAGE, True, tiers, order=order), tiers


def serve(mem: Any, worker: FakeWorker, r: Any, tokens: dict[str, int]) -> None:
    """r's prompt through the bookkeeping, as the scheduler runs a lone request; adds its cached tokens by tier."""
    tiers = mem.tiers
    host0, disk0 = tiers.log.counters["host_hit_pages"], tiers.log.counters["disk_hit_pages"]
    m = mem.match(r)
    assert mem.admit(r, m, r.prompt_len - m.matched_len, 0), f"{r.rid} does not fit the device pool"
    worker.run(mem)
    host, disk = tiers.log.counters["host_hit_pages"] - host0, tiers.log.counters["disk_hit_pages"] - disk0
    tokens["prompt"] += r.prompt_len
    tokens["host"] += host * PAGE
    tokens["disk"] += disk * PAGE
    tokens["device"] += r.kv.kv_len - (host + disk) * PAGE  # the tree's match, with its partial page
    n = r.prompt_len - r.kv.kv_len
    mem.grow(r, n)
    worker.run(mem)
    mem.advance(r, n)
    mem.release(r)
    worker.run(mem)


def replay(run: Replay) -> dict[str, Any]:
    """The trace through run's version; after each request, the unreachable pages by the naive check."""
    import radixrt
    from radixrt.cache import tier_index
    from radixrt.messages import MoveKind, disk_page_name
    from radixrt.namespace import CacheNamespace
    from radixrt.sampling_params import SamplingParams
    from radixrt.scheduler import kv_memory
    from radixrt.scheduler.req import Req

    root = Path(run.root).resolve()
    for mod in (radixrt, kv_memory, tier_index):
        assert Path(mod.__file__).resolve().is_relative_to(root), f"{mod.__name__} from {mod.__file__}, not {root}"
    trace = [json.loads(line) for line in Path(run.trace).read_text().splitlines() if line.strip()]
    parent_of: dict[str, str | None] = {}
    for req in trace:
        keys = tier_index.page_keys(req["input_ids"], PAGE, CacheNamespace(salt=req["tenant"]).encoded)
        parent_of.update(zip(keys, [None, *keys[:-1]]))
    tokens = {"prompt": 0, "device": 0, "host": 0, "disk": 0}
    series: list[tuple[int, int]] = []  # (host, disk) unreachable after each request
    own: list[int] = []  # the new version's own count (KVTiers.unreachable)
    with tempfile.TemporaryDirectory(prefix="kv_tiers_sim_disk_") as d:
        mem, tiers = build(run, d if run.disk_pages else "")
        worker = FakeWorker(Path(d), MoveKind, disk_page_name)
        for i, req in enumerate(trace):
            r = Req(f"r{i}", req["input_ids"], SamplingParams(max_new_tokens=1),
                    namespace=CacheNamespace(salt=req["tenant"]))
            serve(mem, worker, r, tokens)
            on_device = device_keys(mem, tier_index.page_keys)
            if hasattr(mem.cache, "by_key"):
                assert on_device == set(mem.cache.by_key), "the tree's keys differ from its token sequences' keys"
            series.append(unreachable(mem, parent_of, on_device))
            if hasattr(tiers, "unreachable"):
                own.append(len(tiers.unreachable()))
    pages = [h + k for h, k in series]
    return {
        "run": asdict(run),
        "hit_rate": {"total": (tokens["device"] + tokens["host"] + tokens["disk"]) / tokens["prompt"],
                     **{t: tokens[t] / tokens["prompt"] for t in ("device", "host", "disk")}},
        "tokens": tokens,
        "unreachable": {"max_pages": max(pages), "final_pages": pages[-1], "final_host": series[-1][0],
                        "final_disk": series[-1][1], "series": pages, "own_metric_max": max(own) if own else None},
        "tier_stats": tiers.stats(),
    }


# -- the driver ----------------------------------------------------------------------------------------


def old_tree(commit: str, into: Path) -> Path:
    """Unpack commit's radixrt package into `into` (older commits kept kernels/ and lang/ outside
    radixrt/; the scheduler's imports reach neither)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "radixrt"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_replay(run: Replay) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": run.root}
    with tempfile.TemporaryDirectory() as cwd:  # not the repo: `python` puts its cwd's packages first
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--replay", json.dumps(asdict(run))],
                           check=False, env=env, cwd=cwd, capture_output=True, text=True)
    if p.returncode != 0:
        raise RuntimeError(f"replay {run.name} failed:\n{p.stderr}")
    return json.loads(p.stdout.splitlines()[-1])


def runs_for(config: str, old_root: Path, trace: Path, device: int, host: int, disk: int) -> list[Replay]:
    common = {"trace": str(trace), "device_pages": device, "host_pages": host, "disk_pages": disk}
    out = [Replay(f"{config}/old/lru", "old", str(old_root), **common)]
    out += [Replay(f"{config}/new/{p}", "new", str(ROOT), policy=p, **common) for p in POLICIES]
    out.append(Replay(f"{config}/new/lru+write_through", "new", str(ROOT), write_policy="write_through", **common))
    return out


def print_table(result: dict[str, Any]) -> None:
    s = result["sizing"]
    print(f"\n-- {result['trace']['requests']} requests, {result['trace']['prompt_tokens']} prompt tokens; working set "
          f"{s['working_set_pages']} pages of {PAGE}; device {s['device_pages']}, host {s['host_pages']}, disk "
          f"unbounded {s['disk_pages']['unbounded']} / small {s['disk_pages']['small']}; old = {result['old_commit']}")
    print("page bytes (bf16): " + ", ".join(f"{m} {b} B" for m, b in s["page_bytes"].items()))
    head = (f"{'run':34} {'hit':>6} {'vs old':>7} {'device':>7} {'host':>6} {'disk':>6} {'unr.max':>8} {'unr.end':>8} "
            f"{'tiny max':>10} {'smol max':>10} {'drops':>6} {'cascade':>8}")
    print(head)
    print("-" * len(head))
    for name, r in result["runs"].items():
        h, u, st = r["hit_rate"], r["unreachable"], r["tier_stats"]
        cascade = st.get("cascade_dropped_pages", "-")
        print(f"{name:34} {h['total']:6.3f} {r['hit_vs_old_lru']:7.3f} {h['device']:7.3f} {h['host']:6.3f} {h['disk']:6.3f} "
              f"{u['max_pages']:8d} {u['final_pages']:8d} {_mib(u['max_bytes']['llama-tiny']):>10} "
              f"{_mib(u['max_bytes']['SmolLM2-135M']):>10} {st['pages_drop']:6d} {cascade!s:>8}")
    print("hit: cached prompt tokens / prompt tokens (device = tree match incl. its partial page; host, disk = pages "
          "loaded x 16); vs old: hit / old/lru's in the same configuration; unr.: unreachable pages (host + disk slots) "
          "after a request, max over the run and at the end; tiny/smol max: their bytes at the max; drops: disk pages "
          "dropped (DROP moves; without a disk, host memory drops uncounted); cascade: pages dropped with an earlier page of theirs (new only)")


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 1024:.0f} KiB"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(result["configs"])
    cols = 2
    fig, axes = plt.subplots(math.ceil((len(configs) + 1) / cols), cols, figsize=(14, 9.5), squeeze=False)
    axes = list(axes.flat)
    for ax, config in zip(axes, configs):
        names = [n for n in result["runs"] if n.startswith(config + "/")]
        bottom = [0.0] * len(names)
        for tier in ("device", "host", "disk"):
            vals = [result["runs"][n]["hit_rate"][tier] for n in names]
            ax.bar(range(len(names)), vals, bottom=bottom, label=tier)
            bottom = [u + v for u, v in zip(bottom, vals)]
        ax.set_xticks(range(len(names)), [n.split("/", 1)[1] for n in names], rotation=20)
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of prompt tokens cached")
        pages = result["sizing"]["disk_pages"][config]
        ax.set_title(f"hit rate by tier, {config} disk ({pages} pages)" if pages else "hit rate by tier, no disk tier")
        ax.legend()
    ax = axes[len(configs)]
    for ax_unused in axes[len(configs) + 1 :]:
        ax_unused.axis("off")
    for name, r in result["runs"].items():
        if name.endswith(("/old/lru", "/new/lru")):
            ax.plot(r["unreachable"]["series"], label=name, ls="-" if "/old/" in name else "--")
    ax.set_xlabel("request")
    ax.set_ylabel("unreachable pages held (host + disk)")
    ax.set_title("unreachable pages after each request")
    ax.legend(fontsize=8)
    fig.suptitle(f"kv_tiers_sim: {result['trace']['requests']} requests, device 1/4 of the working set, host 1/2; "
                 f"old = {result['old_commit']} (flat LRU), new = prefix order")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", type=Path, default=SAMPLE, help="a JSONL trace (scripts/gen_tenant_trace.py's format)")
    p.add_argument("--old-commit", default=OLD_COMMIT, help="the commit whose radixrt is the 'old' version")
    p.add_argument("--small-disk", type=float, default=SMALL_DISK, help="the small disk tier, as a fraction of the working set")
    p.add_argument("--replay", help=argparse.SUPPRESS)  # internal: one run, in the subprocess
    args = p.parse_args()
    if args.replay:
        print(json.dumps(replay(Replay(**json.loads(args.replay)))))
        return
    start = time.perf_counter()
    trace = args.trace.resolve()
    # The driver only: a replay imports nothing but its version's radixrt. gen_tenant_trace is in scripts/ (via common).
    from common import RESULTS, write_result
    from gen_tenant_trace import read_jsonl, summary, working_set_pages

    ws = working_set_pages(read_jsonl(trace), PAGE)
    device, host = math.ceil(ws / 4), math.ceil(ws / 2)
    disks = {"unbounded": 2 * ws, "small": math.ceil(ws * args.small_disk), "none": 0}
    result: dict[str, Any] = {
        "trace": {**summary(read_jsonl(trace), PAGE), "path": str(trace)}, "old_commit": args.old_commit,
        "sizing": {"working_set_pages": ws, "device_pages": device, "host_pages": host, "disk_pages": disks,
                   "page_bytes": {m: page_bytes(m) for m in MODELS}},
        "configs": disks, "runs": {},
    }
    with tempfile.TemporaryDirectory(prefix="kv_tiers_sim_old_") as tmp:
        old_root = old_tree(args.old_commit, Path(tmp))
        for config, disk in disks.items():
            for run in runs_for(config, old_root, trace, device, host, disk):
                print(f"replaying {run.name} ...", flush=True)
                r = run_replay(run)
                r["run"]["root"] = args.old_commit if run.version == "old" else "checkout"
                result["runs"][run.name] = r
    for name, r in result["runs"].items():
        base = result["runs"][name.split("/")[0] + "/old/lru"]["hit_rate"]["total"]
        r["hit_vs_old_lru"] = r["hit_rate"]["total"] / base if base else math.nan
        u = r["unreachable"]
        u["max_bytes"] = {m: u["max_pages"] * b for m, b in result["sizing"]["page_bytes"].items()}
        u["final_bytes"] = {m: u["final_pages"] * b for m, b in result["sizing"]["page_bytes"].items()}
    print_table(result)
    path = write_result("kv_tiers_sim", result)
    plot(result, RESULTS / "kv_tiers_sim.png")
    print(f"\nwrote {path} and {RESULTS / 'kv_tiers_sim.png'} ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    main()

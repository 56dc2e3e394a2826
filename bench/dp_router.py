"""Data parallelism: two radixrt replicas behind SGLang's router, under three router setups.

  radixrt        cache_aware with `launch_server`'s default thresholds (ServerArgs.router_*)
  sglang_router  cache_aware with sglang_router's own defaults (read from its RouterArgs)
  round_robin    no cache awareness, the baseline

Each setup is a deployment from radixrt/launch/data_parallel.py (the code behind
`launch_server --dp-size 2`): two replicas, one core each on CPU (their share of this process's
affinity), and the router on 127.0.0.1. All three are up at once and take turns, in a rotating
order, on each repetition's workloads; each repetition cuts its documents and conversations from
the corpus turned by ROTATE tokens, so none starts as an earlier one did (what the caches and the
routers' trees hold from it never matches). Requests go to the router as text on the native
/generate (the router's cache-aware tree is built from the request text); greedy, MAX_NEW output
tokens, ignore_eos.

Workloads (cut from the shipped corpus by tests/support/workloads.py):

  sequential_then_load  D documents sent one at a time (sequential cold misses: which replica
                        each reached is recorded), then Q questions on each, all submitted at
                        once (the load lands on documents the replicas already hold)
  shared_documents      D documents x Q questions each, all submitted at once, arrivals
                        round-robin across documents (many users asking about a few documents)
  multi_turn            C conversations x T turns: turn t+1's prompt is turn t's prompt, its
                        answer and a new user message; turns in order, conversations concurrent

Measured per run, over the concurrent part: the cache hit rate (cached prompt tokens / prompt
tokens, from each replica's own /get_server_info counters, summed), the prompt tokens computed
(the misses), the share of prompt tokens each replica served (the balance), and throughput
(prompt + output tokens / s, client wall clock); medians over the repetitions. The ratios radixrt / sglang_router and
radixrt / round_robin are printed and written to bench/results/dp_router.json with a figure
(dp_router.png). NOTE: on llama-tiny a prompt token costs little next to each request's fixed
costs (HTTP, tokenizer, MAX_NEW decode steps), so throughput follows how evenly the replicas are
loaded far more than the computed tokens. The client and both replicas share the machine;
compare the ratios within one run.

    .venv/bin/python bench/dp_router.py [--quick] [--reps N] [--only WORKLOAD ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
from common import RESULTS, ROOT, ensure_model, write_result

sys.path.insert(0, str(ROOT / "tests"))
from support.helpers import corpus_ids, tokenizer
from support.server_proc import free_port
from support.workloads import chat_turn_user_tokens, forks, interleave

from radixrt.config import ServerArgs
from radixrt.launch.data_parallel import DataParallelServer

MAX_NEW = 16
SAMPLING = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
DP = 2
ROTATE = 1237  # tokens the corpus turns by per repetition (coprime with the document lengths)
ROUTER_FIELDS = ("router_cache_threshold", "router_balance_abs_threshold", "router_balance_rel_threshold")


@dataclass(frozen=True)
class Setup:
    name: str
    policy: str
    thresholds: dict[str, Any] = field(default_factory=dict)  # ServerArgs.router_* overrides


def setups(try_abs: tuple[int, ...] = ()) -> list[Setup]:
    """Ours, the router's own defaults (read, not copied), round_robin, and ours with each other
    balance_abs_threshold in try_abs."""
    from sglang_router.router_args import RouterArgs

    theirs = {f: getattr(RouterArgs, f.removeprefix("router_")) for f in ROUTER_FIELDS}
    tried = [Setup(f"abs_{n}", "cache_aware", {"router_balance_abs_threshold": n}) for n in try_abs]
    return [Setup("radixrt", "cache_aware"), *tried, Setup("sglang_router", "cache_aware", theirs),
            Setup("round_robin", "round_robin")]


@dataclass(frozen=True)
class Sizes:
    docs: int = 8
    doc_len: int = 800
    questions: int = 24
    seq_docs: int = 6  # sequential_then_load
    seq_questions: int = 16
    conversations: int = 32
    turns: int = 6
    concurrency: int = 32  # requests in flight at most


SIZES = {"full": Sizes(), "quick": Sizes(docs=4, doc_len=400, questions=8, seq_docs=6, seq_questions=6,
                                          conversations=8, turns=3, concurrency=16)}


@dataclass(frozen=True)
class Workload:
    name: str
    about: str
    prompts: list[str]  # all submitted at once (empty for a conversation workload)
    conversations: list[list[str]] = field(default_factory=list)  # [conversation][turn] -> the user's new text
    sequential: list[str] = field(default_factory=list)  # sent one at a time first, each alone


def build_workloads(path: Any, s: Sizes, rep: int) -> list[Workload]:
    """Repetition rep's workloads: the corpus rotated by rep * ROTATE tokens, so that no document
    starts where an earlier repetition's did (the routers' trees and the caches still hold those)."""
    ids, tok = corpus_ids(path), tokenizer(path)
    corpus = ids[rep * ROTATE :] + ids[: rep * ROTATE]
    text = lambda prompts: [tok.decode(p) for p in prompts]
    docs = forks(corpus, s.docs, s.doc_len, s.questions, seed=rep).prompts
    later = corpus[s.docs * s.doc_len:]  # documents of their own for sequential_then_load
    seq = forks(later, s.seq_docs, s.doc_len, s.seq_questions, seed=rep).prompts
    chats = chat_turn_user_tokens(corpus, s.conversations, s.turns, seed=rep)
    return [
        Workload("sequential_then_load", f"{s.seq_docs} documents of {s.doc_len} tokens sent one at a time, then "
                 f"{s.seq_questions} questions on each at once", text(interleave(_groups(seq, s.seq_questions))),
                 sequential=text([later[i * s.doc_len : (i + 1) * s.doc_len] for i in range(s.seq_docs)])),
        Workload("shared_documents", f"{s.docs} documents of {s.doc_len} tokens x {s.questions} questions, round-robin",
                 text(interleave(_groups(docs, s.questions)))),
        Workload("multi_turn", f"{s.conversations} conversations x {s.turns} turns, each turn extends its history",
                 [], [text(conv) for conv in chats]),
    ]


def _groups(prompts: list, size: int) -> list[list]:
    return [prompts[i : i + size] for i in range(0, len(prompts), size)]


# -- running one workload against one deployment -----------------------------------------


def generate(url: str, text: str) -> str:
    r = requests.post(url + "/generate", json={"text": text, "sampling_params": SAMPLING}, timeout=600)
    r.raise_for_status()
    return r.json()["text"]


def conversation(url: str, turns: list[str]) -> int:
    """Run the turns in order, each on top of the history; the number of requests."""
    history = ""
    for user in turns:
        prompt = history + user
        history = prompt + generate(url, prompt)
    return len(turns)


def submit(url: str, wl: Workload, concurrency: int) -> int:
    """Every concurrent request of wl; the number sent."""
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        if wl.conversations:
            return sum(pool.map(lambda turns: conversation(url, turns), wl.conversations))
        return len(list(pool.map(lambda p: generate(url, p), wl.prompts)))


def counters(url: str) -> dict[str, int]:
    info = requests.get(url + "/get_server_info", timeout=30).json()
    return {k: info[k] for k in ("prompt_tokens", "cached_prompt_tokens")}


def send_alone(dp: DataParallelServer, prompts: list[str]) -> list[int]:
    """Each prompt after the last one finished; the replica that computed each (its prompt count moved)."""
    served = []
    for prompt in prompts:
        before = [counters(u)["prompt_tokens"] for u in dp.replica_urls]
        generate(dp.url, prompt)
        moved = [counters(u)["prompt_tokens"] - b for u, b in zip(dp.replica_urls, before)]
        served.append(max(range(len(moved)), key=moved.__getitem__))
    return served


def warm(urls: list[str]) -> None:
    """A short request straight to each replica (first-step costs), then empty caches."""
    for url in urls:
        generate(url, "warm up " * 8)
        requests.post(url + "/flush_cache", timeout=30).raise_for_status()


def measure(dp: DataParallelServer, wl: Workload, concurrency: int) -> dict[str, Any]:
    """wl's sequential requests, then its concurrent part, timed and counted."""
    sequential = send_alone(dp, wl.sequential)
    before = [counters(u) for u in dp.replica_urls]
    start = time.perf_counter()
    n = submit(dp.url, wl, concurrency)
    wall = time.perf_counter() - start
    per = [{k: a[k] - b[k] for k in a} for a, b in zip([counters(u) for u in dp.replica_urls], before)]
    prompt = sum(p["prompt_tokens"] for p in per)
    cached = sum(p["cached_prompt_tokens"] for p in per)
    return {
        "sequential_replicas": sequential,  # which replica each sequential (cold) request reached
        "requests": n,
        "wall_s": wall,
        "tok_s": (prompt + n * MAX_NEW) / wall,
        "hit_rate": cached / max(prompt, 1),
        "computed_prompt_tokens": prompt - cached,  # the prefill work the caches did not save
        "replica_prompt_share": [p["prompt_tokens"] / max(prompt, 1) for p in per],
    }


def run_all(args_for: Callable[[Setup], ServerArgs], path: Any, sizes: Sizes, reps: int, only: list[str] | None,
            compared: list[Setup]) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """[workload][setup] -> one measurement per repetition. Every setup's deployment is up at
    once (idle ones cost nothing) and they take turns, in a rotating order, on each repetition's
    workload, so that a slow spell of this shared machine falls on all of them alike."""
    names = [s.name for s in compared]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with contextlib.ExitStack() as stack:
        dps = {s.name: stack.enter_context(DataParallelServer(args_for(s), s.policy)) for s in compared}
        for dp in dps.values():
            warm(dp.replica_urls)
        for rep in range(reps):
            for wl in build_workloads(path, sizes, rep):
                if only and wl.name not in only:
                    continue
                for name in names[rep % len(names):] + names[: rep % len(names)]:
                    runs.setdefault(wl.name, {n: [] for n in names})[name].append(measure(dps[name], wl, sizes.concurrency))
    return runs


def summarize(about: str, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Medians over the repetitions; throughput ratios also per repetition (each pair ran back to back)."""
    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "hit_rate", "computed_prompt_tokens")}
           | {"busiest_replica_share": statistics.median(max(r["replica_prompt_share"]) for r in rs),
              "sequential_distinct_replicas": max(len(set(r["sequential_replicas"])) for r in rs)}
           for name, rs in runs.items()}
    ours = med["radixrt"]
    return {
        "about": about,
        "setups": med,
        "ratios": {other: {
            "hit_rate": ours["hit_rate"] / max(med[other]["hit_rate"], 1e-9),
            "throughput": ours["tok_s"] / med[other]["tok_s"],
            "throughput_per_repetition": [a["tok_s"] / b["tok_s"] for a, b in zip(runs["radixrt"], runs[other])],
            "computed_prompt_tokens": ours["computed_prompt_tokens"] / max(med[other]["computed_prompt_tokens"], 1),
        } for other in med if other != "radixrt"},
        "runs": runs,
    }


def print_workload(name: str, w: dict[str, Any]) -> None:
    print(f"\n-- {name}: {w['about']} (medians of {len(w['runs']['radixrt'])} repetitions)")
    print(f"{'setup':14s} {'hit rate':>8s} {'tok/s':>8s} {'busiest share':>13s}  sequential requests' replicas")
    for setup, r in w["setups"].items():
        seq = [run["sequential_replicas"] for run in w["runs"][setup]]
        print(f"{setup:14s} {r['hit_rate']:8.1%} {r['tok_s']:8.0f} {r['busiest_replica_share']:13.0%}  {seq if seq[0] else ''}")
    for other, q in w["ratios"].items():
        each = ", ".join(f"{x:.2f}" for x in q["throughput_per_repetition"])
        print(f"radixrt / {other}: hit rate {q['hit_rate']:.2f}x, throughput {q['throughput']:.2f}x ({each}),"
              f" computed prompt tokens {q['computed_prompt_tokens']:.2f}x")


def plot(work: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(work)
    labels = list(work[names[0]]["setups"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    width = 0.8 / len(labels)
    panels = [("busiest replica's share of prompt tokens", lambda r: r["busiest_replica_share"], (0.4, 1.02)),
              ("cache hit rate", lambda r: r["hit_rate"], (0, 1.02)),
              ("throughput (prompt + output tokens / s)", lambda r: r["tok_s"], None)]
    for ax, (title, value, ylim) in zip(axes, panels):
        for i, label in enumerate(labels):
            ax.bar([x + i * width for x in range(len(names))], [value(work[n]["setups"][label]) for n in names], width, label=label)
        ax.set_xticks([x + width * (len(labels) - 1) / 2 for x in range(len(names))], names, fontsize=8)
        ax.set_title(title, fontsize=10)
        if ylim:
            ax.set_ylim(*ylim)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"llama-tiny, dp {DP} behind sglang_router: router setups, medians of repetitions (bench/dp_router.py)", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller workloads, for a smoke run")
    parser.add_argument("--reps", type=int, default=3, help="repetitions, each on fresh text")
    parser.add_argument("--only", nargs="*", help="run only these workloads")
    parser.add_argument("--try-abs", nargs="*", type=int, default=[], help="also ours with these balance_abs_thresholds")
    opts = parser.parse_args()
    if len(os.sched_getaffinity(0)) < DP:
        raise SystemExit(f"needs {DP} cores (one per replica); this process may run on {len(os.sched_getaffinity(0))}")
    path = ensure_model("llama", "tiny")
    sizes = SIZES["quick" if opts.quick else "full"]

    def args_for(setup: Setup) -> ServerArgs:  # a fresh public port per deployment
        base = ServerArgs(model_path=str(path), dtype="float32", page_size=16, max_total_tokens=32768, dp_size=DP,
                          port=free_port(), log_level="warning")
        return dataclasses.replace(base, **setup.thresholds)

    compared = setups(tuple(opts.try_abs))
    configs = {s.name: {"policy": s.policy} | {k: getattr(args_for(s), k) for k in ROUTER_FIELDS} for s in compared}
    print(f"== llama-tiny, dp {DP} behind sglang_router, {MAX_NEW} greedy output tokens; sizes {sizes}")
    print("setups:", configs)
    abouts = {wl.name: wl.about for wl in build_workloads(path, sizes, 0)}
    work = {name: summarize(abouts[name], runs) for name, runs in run_all(args_for, path, sizes, opts.reps, opts.only, compared).items()}
    for name, w in work.items():
        print_workload(name, w)
    name = "dp_router" + ("-quick" if opts.quick else "")
    out = write_result(name, {"model": "llama-tiny", "dp_size": DP, "max_new_tokens": MAX_NEW, "sizes": vars(sizes),
                              "repetitions": opts.reps, "setups": configs, "workloads": work})
    plot(work, RESULTS / f"{name}.png")
    print("\nwrote", out, "and", RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()

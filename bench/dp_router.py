"""Data parallelism: two radixrt replicas behind SGLang's router, cache_aware vs round_robin.

Each (workload, policy) pair runs on a fresh deployment from
radixrt/launch/data_parallel.py (the code behind `launch_server --dp-size 2`): two
replicas with empty caches, one core each on CPU (their share of this process's
affinity), and the router with the policy under test on 127.0.0.1. Requests go to
the router as text on the native /generate (the router's cache-aware tree is built
from the request text); greedy, MAX_NEW output tokens, ignore_eos.

Workloads (cut from the shipped corpus by tests/support/workloads.py):

  shared_documents  D documents x Q questions each, all submitted at once, arrivals
                    round-robin across documents (many users asking about a few
                    shared documents)
  multi_turn        C conversations x T turns: turn t+1's prompt is turn t's prompt,
                    its answer and a new user message; turns in order within a
                    conversation, conversations concurrent

Measured per run: the cache hit rate (cached prompt tokens / prompt tokens, from each
replica's own /get_server_info counters over the run, summed), the prompt tokens
computed (the misses: the prefill work the caches did not save), the share of prompt
tokens each replica served (the balance), and throughput (prompt + output tokens / s,
requests / s, client wall clock). NOTE: on llama-tiny a prompt token costs little next
to each request's fixed costs (HTTP, router, tokenizer, 16 decode steps), so throughput
barely follows the computed tokens (one run on the 2-core box: round_robin computed
1.68x the prompt tokens of cache_aware on both workloads, at 1.01-1.02x the
throughput); the computed-token ratio is what a model with costly prefill would feel. The ratios cache_aware / round_robin are printed and
written with the runs to bench/results/dp_router.json. NOTE: the client and both
replicas share the machine; compare the ratios within one run.

    .venv/bin/python bench/dp_router.py [--quick]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable

import requests
from common import ROOT, ensure_model, write_result

sys.path.insert(0, str(ROOT / "tests"))
from support.helpers import corpus_ids, tokenizer  # noqa: E402
from support.server_proc import free_port  # noqa: E402
from support.workloads import chat_turn_user_tokens, forks, interleave  # noqa: E402

from radixrt.config import ServerArgs  # noqa: E402
from radixrt.launch.data_parallel import DataParallelServer  # noqa: E402

MAX_NEW = 16
SAMPLING = {"max_new_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True}
POLICIES = ("cache_aware", "round_robin")
DP = 2


@dataclass(frozen=True)
class Sizes:
    docs: int = 8
    doc_len: int = 800
    questions: int = 24
    conversations: int = 32
    turns: int = 6
    concurrency: int = 32  # requests in flight at most


SIZES = {"full": Sizes(), "quick": Sizes(docs=4, doc_len=400, questions=8, conversations=8, turns=3, concurrency=16)}


@dataclass(frozen=True)
class Workload:
    name: str
    about: str
    prompts: list[str]  # all submitted at once (empty for a conversation workload)
    conversations: list[list[str]]  # [conversation][turn] -> the user's new text


def build_workloads(path: Any, s: Sizes) -> list[Workload]:
    corpus, tok = corpus_ids(path), tokenizer(path)
    docs = forks(corpus, s.docs, s.doc_len, s.questions).prompts
    groups = [docs[i : i + s.questions] for i in range(0, len(docs), s.questions)]
    chats = chat_turn_user_tokens(corpus, s.conversations, s.turns)
    return [
        Workload("shared_documents", f"{s.docs} documents of {s.doc_len} tokens x {s.questions} questions, round-robin",
                 [tok.decode(p) for p in interleave(groups)], []),
        Workload("multi_turn", f"{s.conversations} conversations x {s.turns} turns, each turn extends its history",
                 [], [[tok.decode(u) for u in conv] for conv in chats]),
    ]


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
    """Every request of wl; the number sent."""
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        if wl.conversations:
            return sum(pool.map(lambda turns: conversation(url, turns), wl.conversations))
        return len(list(pool.map(lambda p: generate(url, p), wl.prompts)))


def counters(url: str) -> dict[str, int]:
    info = requests.get(url + "/get_server_info", timeout=30).json()
    return {k: info[k] for k in ("prompt_tokens", "cached_prompt_tokens")}


def warm(urls: list[str]) -> None:
    """A short request straight to each replica (first-step costs), then empty caches."""
    for url in urls:
        generate(url, "warm up " * 8)
        requests.post(url + "/flush_cache", timeout=30).raise_for_status()


def run(args: ServerArgs, wl: Workload, policy: str, concurrency: int) -> dict[str, Any]:
    with DataParallelServer(args, policy) as dp:
        warm(dp.replica_urls)
        before = [counters(u) for u in dp.replica_urls]
        start = time.perf_counter()
        n = submit(dp.url, wl, concurrency)
        wall = time.perf_counter() - start
        after = [counters(u) for u in dp.replica_urls]
    per = [{k: a[k] - b[k] for k in a} for a, b in zip(after, before)]
    prompt = sum(p["prompt_tokens"] for p in per)
    cached = sum(p["cached_prompt_tokens"] for p in per)
    tokens = prompt + n * MAX_NEW
    return {
        "requests": n,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "req_s": n / wall,
        "hit_rate": cached / max(prompt, 1),
        "computed_prompt_tokens": prompt - cached,  # the prefill work the caches did not save
        "replica_prompt_share": [p["prompt_tokens"] / max(prompt, 1) for p in per],
        "replica_hit_rate": [p["cached_prompt_tokens"] / max(p["prompt_tokens"], 1) for p in per],
    }


def run_workload(args_for: Callable[[], ServerArgs], wl: Workload, concurrency: int) -> dict[str, Any]:
    runs = {policy: run(args_for(), wl, policy, concurrency) for policy in POLICIES}
    ca, rr = runs["cache_aware"], runs["round_robin"]
    return {
        "about": wl.about,
        "policies": runs,
        "hit_rate_ratio": ca["hit_rate"] / max(rr["hit_rate"], 1e-9),
        "throughput_ratio": ca["tok_s"] / rr["tok_s"],
        "computed_prompt_tokens_ratio": rr["computed_prompt_tokens"] / max(ca["computed_prompt_tokens"], 1),
    }


def print_workload(name: str, w: dict[str, Any]) -> None:
    print(f"\n-- {name}: {w['about']}")
    print(f"{'policy':12s} {'hit rate':>8s} {'tok/s':>8s} {'req/s':>6s} {'wall s':>7s}  per replica: prompt share / hit rate")
    for policy, r in w["policies"].items():
        replicas = "  ".join(f"{s:.0%}/{h:.0%}" for s, h in zip(r["replica_prompt_share"], r["replica_hit_rate"]))
        print(f"{policy:12s} {r['hit_rate']:8.1%} {r['tok_s']:8.0f} {r['req_s']:6.2f} {r['wall_s']:7.2f}  {replicas}")
    print(f"cache_aware / round_robin: hit rate {w['hit_rate_ratio']:.2f}x, throughput {w['throughput_ratio']:.2f}x;"
          f" round_robin computed {w['computed_prompt_tokens_ratio']:.2f}x the prompt tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller workloads, for a smoke run")
    opts = parser.parse_args()
    if len(os.sched_getaffinity(0)) < DP:
        raise SystemExit(f"needs {DP} cores (one per replica); this process may run on {len(os.sched_getaffinity(0))}")
    path = ensure_model("llama", "tiny")
    sizes = SIZES["quick" if opts.quick else "full"]

    def args_for() -> ServerArgs:  # a fresh public port per deployment
        return ServerArgs(model_path=str(path), dtype="float32", page_size=16, max_total_tokens=32768, dp_size=DP,
                          port=free_port(), log_level="warning")

    print(f"== llama-tiny, dp {DP} behind sglang_router, {MAX_NEW} greedy output tokens; sizes {sizes}")
    work = {}
    for wl in build_workloads(path, sizes):
        work[wl.name] = run_workload(args_for, wl, sizes.concurrency)
        print_workload(wl.name, work[wl.name])
    out = write_result("dp_router" + ("-quick" if opts.quick else ""), {
        "model": "llama-tiny", "dp_size": DP, "max_new_tokens": MAX_NEW, "sizes": vars(sizes), "workloads": work,
    })
    print("\nwrote", out)


if __name__ == "__main__":
    main()

"""Frontend programs against our server: radix cache on vs off, radixrt.lang vs SGLang's own frontend.

The model is the demo model, assets/world-llama (a small Llama trained on the invented world
of scripts/world.py, "the Vell Valley"), served in float32; both frontends render its prompts
with the ChatML template it was trained on. Two programs, each written twice:

  tree_of_thought  examples/tree_of_thought.py: after the system turn, fork one branch per
                   candidate (ask what they do: an 8-token greedy answer; ask where they live: a
                   select over the towns), join, and build the conclusion in Python.
                   Over a list of (town, 3 candidates) items drawn from the world, with run_batch
  rag              examples/rag_pipeline.py's `answer` (two retrieved town documents in the
                   prompt, a 12-token greedy answer), over the example's questions plus more
                   person questions (world.PERSON_QUESTIONS) over the same eight documents,
                   with run_batch

The radixrt.lang versions are the examples' own @rt.function programs, imported; the SGLang
versions below are line-for-line ports (same text, same max_tokens and temperature, same select
choices, the same conclusion computed in Python) with `import sglang as sgl`. Our server speaks
SGLang's native API, so SGLang's frontend runs against it unchanged.

Configurations, all in one run: a server with the radix cache on, then a fresh one with
--disable-radix-cache; on each, both programs with both frontends. Each frontend's run_batch gets
the same thread count. Before the measured runs each program runs on two items per frontend
(warm-up); the cache is flushed before every measured run, so each run starts cold. Each
configuration is measured --repeats times (3), the rounds interleaved, and the run of median wall
time is kept.

The frontends do not send exactly the same requests: SGLang's run_batch first traces the program
and sends its constant prefix (the system turn) as one prefill-only request, so on rag its
prompt-token count is a little higher. On tree_of_thought it is lower: our fork sends the text so
far (the system turn) as a prefill-only request in every program, while SGLang's fork tests its
text before its worker thread has appended the system turn, finds it empty and sends none (seen
in the requests it sends; the traced prefix stands in). Both score a select's choices with the
same arithmetic (radixrt/lang/scoring.py follows SGLang's frontend: the mean prompt logprob from two tokens
before the boundary, with its token healing), so on equal prompts the selected towns agree too.

Per run: wall time, programs/s, generated tokens/s (the server's generation_tokens counter from
/metrics, so both frontends are counted the same way), the prompt tokens the server received,
and the hit rate (cached / prompt tokens, from /get_server_info's counters before and after).
The ratios printed: cache on / off per frontend, and radixrt.lang / SGLang's frontend on the
same server. Agreement: both programs are greedy, so every run's whole result is compared with
radixrt.lang's on the cache-on server: for rag the full program text; for tree_of_thought the
prompt up to the fork (the system turn), each branch's answer and town, and the conclusion.
A disagreement there means different tokens from the server (or a port that drifted), not
sampling.

NOTE: the client shares the 2-vCPU dev box with the server (and with other jobs); compare the
ratios within one run rather than absolute figures across runs.

    .venv/bin/python bench/dsl_programs.py [--quick] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import requests
import sglang as sgl
from common import RESULTS, ROOT, write_result

import radixrt as rt
from radixrt.ops.prom import Scrape

sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "examples"))
from rag_pipeline import QUESTIONS as EXAMPLE_QUESTIONS  # noqa: E402
from rag_pipeline import answer, load_docs, retrieve  # noqa: E402
from support.server_proc import running_server  # noqa: E402
from tree_of_thought import CHAT_TEMPLATE, SYSTEM, TOWNS, conclusion, tree_of_thought  # noqa: E402
from world import PERSON_QUESTIONS, load_world  # noqa: E402  (scripts/, put on sys.path by common)

MODEL = ROOT / "assets" / "world-llama"
FRONTENDS = ("radixrt.lang", "sglang")
# tree_of_thought forks right after the system turn: its text, as ChatML renders it, ends the
# parent's prompt at the fork (and, since join gathers variables only, the parent's whole text).
FORK_MARK = f"{SYSTEM}<|im_end|>\n"
SERVER_ARGS = ("--dtype", "float32", "--page-size", "16", "--max-total-tokens", "65536")

# -- the SGLang-frontend ports ------------------------------------------------------------------


@sgl.function
def sgl_tree_of_thought(s, town: str, candidates: list[str]) -> None:
    s += sgl.system(SYSTEM)
    forks = s.fork(len(candidates))
    forks += lambda i: sgl.user(f"What does {candidates[i]} do for a living?")
    forks += sgl.assistant(sgl.gen("thought", max_tokens=8, temperature=0))
    forks += lambda i: sgl.user(f"Where does {candidates[i]} live?")
    forks += sgl.assistant(sgl.select("town", TOWNS))
    forks.join()  # s["thought"], s["town"]: one entry per branch
    # (the example also records forks.prefix_meta, a radixrt.lang extra with no SGLang equivalent)
    s["conclusion"] = conclusion(town, candidates, s["town"])


@sgl.function
def sgl_answer(s, question: str, documents: list[str]) -> None:
    s += sgl.system("Answer the question using only the documents. Be brief.")
    with s.user():
        for doc in documents:
            s += f"Document:\n{doc}\n\n"
        s += f"Question: {question}"
    s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))


def backend_for(frontend: str, url: str) -> Any:
    # Both frontends would pick SGLang's "default" template (SYSTEM:/USER: prefixes) for the
    # model's path; it was trained on ChatML, so both name it, as the examples do.
    if frontend == "radixrt.lang":
        return rt.RuntimeEndpoint(url, chat_template_name=CHAT_TEMPLATE)
    return sgl.RuntimeEndpoint(url, chat_template_name=CHAT_TEMPLATE)


# -- workloads ----------------------------------------------------------------------------------


def tot_items(rounds: int = 2, seed: int = 0) -> list[dict[str, Any]]:
    """tree_of_thought's arguments: per round, every town with three candidates, one who lives
    there and two who do not, in a seeded order (so each branch's select has a right answer)."""
    world, rng = load_world(), random.Random(seed)
    items = []
    for _ in range(rounds):
        for town in world["towns"]:
            residents = [p["name"] for p in world["people"] if p["town"] == town["name"]]
            others = [p["name"] for p in world["people"] if p["town"] != town["name"]]
            candidates = rng.sample(residents, 1) + rng.sample(others, 2)
            rng.shuffle(candidates)
            items.append({"town": town["name"], "candidates": candidates})
    return items


def person_questions(per_person: int = 2, seed: int = 0) -> list[str]:
    """`per_person` questions about every person of the world, each on a different attribute in a
    seeded phrasing, shuffled so that any first n spread over the town documents."""
    rng = random.Random(seed)
    questions = []
    for person in load_world()["people"]:
        for attribute in rng.sample(sorted(PERSON_QUESTIONS), per_person):
            questions.append(rng.choice(PERSON_QUESTIONS[attribute]).format(name=person["name"]))
    rng.shuffle(questions)
    return questions


TOT_ITEMS = tot_items()  # 16: two rounds over the eight towns
# The example's eight questions first, then two more per person (64), none repeated.
RAG_QUESTIONS = EXAMPLE_QUESTIONS + [q for q in person_questions() if q not in EXAMPLE_QUESTIONS]


@dataclass(frozen=True)
class Workload:
    """One program over a batch of arguments, in both frontends."""

    name: str
    batch: list[dict[str, Any]]
    programs: dict[str, Any]  # frontend -> its @function (both have run_batch(batch, backend=, num_threads=))
    compared: Callable[[Any], str]  # a finished state -> the text the agreement check compares
    compared_what: str


def tot_outcome(s: Any) -> str:
    """A finished tree_of_thought as text: the prompt up to the fork, each branch's answer and
    town, the conclusion. Raises if the program's text does not end at the fork."""
    prefix = s.text()
    if not prefix.endswith(FORK_MARK):
        raise ValueError(f"tree_of_thought's text should end with its system turn {FORK_MARK!r}, got {prefix!r}")
    branches = "".join(f"{thought!r} -> {lives_in}\n" for thought, lives_in in zip(s["thought"], s["town"]))
    return f"{prefix}{branches}{s['conclusion']}"


def tot_workload(n: int) -> Workload:
    return Workload("tree_of_thought", TOT_ITEMS[:n], {"radixrt.lang": tree_of_thought, "sglang": sgl_tree_of_thought},
                    tot_outcome, "prompt up to the fork, answers, towns, conclusion")


def rag_workload(n: int) -> Workload:
    docs = load_docs()
    batch = [{"question": q, "documents": [docs[name] for name in retrieve(q, docs)]} for q in RAG_QUESTIONS[:n]]
    return Workload("rag", batch, {"radixrt.lang": answer, "sglang": sgl_answer},
                    lambda s: s.text(), "full text (prompt + greedy answer)")


@dataclass(frozen=True)
class Sizes:
    tot_items: int  # (town, 3 candidates) items: 3 branches each
    rag_questions: int


SIZES = {"full": Sizes(tot_items=16, rag_questions=48), "quick": Sizes(tot_items=4, rag_questions=12)}

# -- one measured run ---------------------------------------------------------------------------


def server_counters(url: str) -> dict[str, float]:
    """The server's running totals: prompt and cached prompt tokens, generated tokens."""
    info = requests.get(f"{url}/get_server_info", timeout=60).json()
    scrape = Scrape.parse(requests.get(f"{url}/metrics", timeout=60).text)
    return {"prompt_tokens": info["prompt_tokens"], "cached_prompt_tokens": info["cached_prompt_tokens"],
            "generation_tokens": scrape.value("sglang:generation_tokens_total")}


@dataclass(frozen=True)
class Run:
    workload: str
    frontend: str
    cache: str  # "on" | "off"
    programs: int
    failed: int
    wall_s: float
    programs_per_s: float
    generated_tokens: int
    generated_tok_s: float
    prompt_tokens: int
    hit_rate: float
    wall_s_repeats: list[float] = field(default_factory=list)  # every repeat's wall time, sorted


def measure(url: str, cache: str, w: Workload, frontend: str, threads: int) -> tuple[Run, list[str | None]]:
    """Flush the cache, run the batch, and read the server's counters around it; also the compared texts."""
    backend = backend_for(frontend, url)
    requests.post(f"{url}/flush_cache", timeout=60).raise_for_status()
    before = server_counters(url)
    t = time.perf_counter()
    states = w.programs[frontend].run_batch(w.batch, backend=backend, num_threads=threads)
    wall = time.perf_counter() - t
    after = server_counters(url)
    delta = {k: after[k] - before[k] for k in after}
    ok = [s.error() is None for s in states]
    texts = [w.compared(s) if good else None for s, good in zip(states, ok)]
    run = Run(w.name, frontend, cache, len(states), ok.count(False), wall, sum(ok) / wall,
              int(delta["generation_tokens"]), delta["generation_tokens"] / wall, int(delta["prompt_tokens"]),
              delta["cached_prompt_tokens"] / delta["prompt_tokens"] if delta["prompt_tokens"] else 0.0)
    return run, texts


def run_server(path: Path, cache: str, workloads: list[Workload], threads: int,
               repeats: int) -> list[tuple[Run, list]]:
    """A fresh server; a warm-up pass of every program, then every (workload, frontend) measured
    `repeats` times, interleaved so that a slow spell on the shared machine hits all of them; each
    keeps its run of median wall time (with the wall times of all its repeats)."""
    extra = () if cache == "on" else ("--disable-radix-cache",)
    keys = [(w, f) for w in workloads for f in FRONTENDS]
    with running_server(path, *SERVER_ARGS, *extra) as (url, _):
        for w, f in keys:
            w.programs[f].run_batch(w.batch[:2], backend=backend_for(f, url), num_threads=2)
        rounds = [[measure(url, cache, w, f, threads) for w, f in keys] for _ in range(repeats)]
    chosen = []
    for i in range(len(keys)):
        tries = sorted((r[i] for r in rounds), key=lambda m: m[0].wall_s)
        run, texts = tries[len(tries) // 2]
        chosen.append((replace(run, wall_s_repeats=[m[0].wall_s for m in tries]), texts))
    return chosen


# -- reports --------------------------------------------------------------------------------------


def print_table(runs: list[Run]) -> None:
    print(f"\n{'program':16s} {'frontend':13s} {'cache':5s} {'done':>7s} {'wall s':>7s} {'(repeats)':>11s}"
          f" {'prog/s':>7s} {'gen tok/s':>9s} {'prompt tok':>10s} {'hit rate':>8s}")
    for r in runs:
        spread = f"{min(r.wall_s_repeats):.2f}-{max(r.wall_s_repeats):.2f}"
        print(f"{r.workload:16s} {r.frontend:13s} {r.cache:5s} {r.programs - r.failed:3d}/{r.programs:<3d}"
              f" {r.wall_s:7.2f} {spread:>11s} {r.programs_per_s:7.2f} {r.generated_tok_s:9.1f} {r.prompt_tokens:10d}"
              f" {r.hit_rate:8.1%}")


def ratios(runs: list[Run]) -> dict[str, float]:
    """programs/s ratios: cache on / off per frontend, and radixrt.lang / sglang per server."""
    by = {(r.workload, r.frontend, r.cache): r.programs_per_s for r in runs}
    out = {}
    for w in dict.fromkeys(r.workload for r in runs):
        for f in FRONTENDS:
            out[f"{w}: {f} cache on / off"] = by[w, f, "on"] / by[w, f, "off"]
        for c in ("on", "off"):
            out[f"{w}: radixrt.lang / sglang, cache {c}"] = by[w, "radixrt.lang", c] / by[w, "sglang", c]
    return out


def agreement(workloads: list[Workload], texts: dict[tuple[str, str, str], list]) -> dict[str, Any]:
    """Per workload and run: how many programs' compared texts equal radixrt.lang's on the cache-on server."""
    out = {}
    for w in workloads:
        ref = texts[w.name, "radixrt.lang", "on"]
        counts = {}
        for (name, frontend, cache), got in texts.items():
            if name == w.name and (frontend, cache) != ("radixrt.lang", "on"):
                counts[f"{frontend} cache {cache}"] = sum(a is not None and a == b for a, b in zip(ref, got))
        out[w.name] = {"compared": w.compared_what, "programs": len(w.batch), "same_as_radixrt_lang_cache_on": counts}
    return out


def plot(runs: list[Run], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.workload for r in runs))
    fig, axes = plt.subplots(1, len(names), figsize=(6 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names):
        for i, cache in enumerate(("on", "off")):
            rows = [next(r for r in runs if (r.workload, r.frontend, r.cache) == (name, f, cache)) for f in FRONTENDS]
            bars = ax.bar([x + (i - 0.5) * 0.38 for x in range(len(FRONTENDS))], [r.programs_per_s for r in rows],
                          0.38, label=f"radix cache {cache}")
            ax.bar_label(bars, [f"{r.programs_per_s:.1f}\nhit {r.hit_rate:.0%}" for r in rows], fontsize=7)
        ax.set_xticks(range(len(FRONTENDS)), FRONTENDS)
        ax.set(ylabel="programs/s", title=f"{name}: {rows[0].programs} programs")
        ax.margins(y=0.2)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def report(runs: list[Run], workloads: list[Workload], texts: dict[tuple[str, str, str], list]) -> dict[str, Any]:
    """Print the table, the ratios and the agreement counts; return the ratios and counts."""
    print_table(runs)
    rat = ratios(runs)
    print("\nprograms/s ratios:")
    for k, v in rat.items():
        print(f"  {k:42s} {v:5.2f}x")
    agree = agreement(workloads, texts)
    print("\nagreement with radixrt.lang on the cache-on server:")
    for name, a in agree.items():
        counts = ", ".join(f"{k} {v}/{a['programs']}" for k, v in a["same_as_radixrt_lang_cache_on"].items())
        print(f"  {name} ({a['compared']}): {counts}")
    return {"ratios": rat, "agreement": agree}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="4 tree-of-thought and 12 rag programs, 1 repeat, for a smoke run (writes no results)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads in the server's processes (OMP_NUM_THREADS)")
    parser.add_argument("--repeats", type=int,
                        help="measured runs per configuration, the median kept (default 3, quick 1)")
    parser.add_argument("--client-threads", type=int, default=64, help="run_batch threads, the same for both frontends")
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # inherited by the server and its workers
    sizes = SIZES["quick" if args.quick else "full"]
    repeats = args.repeats or (1 if args.quick else 3)
    workloads = [tot_workload(sizes.tot_items), rag_workload(sizes.rag_questions)]
    if not (MODEL / "SHA256SUMS").exists():
        raise SystemExit(f"no demo model at {MODEL} (its SHA256SUMS is missing): scripts/train_demo_model.py writes it")
    load_avg = os.getloadavg()[0]
    print(f"== world-llama (float32), {args.threads} torch thread(s), run_batch with {args.client_threads} threads;"
          f" machine load average {load_avg:.1f} on {os.cpu_count()} CPUs before the run")
    print(f"tree_of_thought: {sizes.tot_items} towns x 3 candidates (branches); rag: {sizes.rag_questions} questions;"
          f" {repeats} measured repeat(s) each, median kept; cache flushed before each")
    start = time.perf_counter()
    measured = [m for cache in ("on", "off") for m in run_server(MODEL, cache, workloads, args.client_threads, repeats)]
    runs = [run for run, _ in measured]
    summary = report(runs, workloads, {(r.workload, r.frontend, r.cache): t for r, t in measured})
    print(f"\ntotal {time.perf_counter() - start:.0f} s")
    if args.quick:  # a smoke run: leave the full run's results in place
        return
    print("wrote", write_result("dsl_programs", {
        "model": "world-llama", "threads": args.threads, "client_threads": args.client_threads, "repeats": repeats,
        "load_avg_before": load_avg, "sizes": asdict(sizes), "runs": [asdict(r) for r in runs], **summary}))
    plot(runs, RESULTS / "dsl_programs.png")
    print("wrote", RESULTS / "dsl_programs.png")


if __name__ == "__main__":
    main()

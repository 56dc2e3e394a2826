"""Bounded-KV retention (sampling_params.kv_retention) on the demo model: what a KV budget costs and buys.

The demo model (assets/world-llama: 4 layers, a 2,048-token context, trained on the
invented Vell Valley of scripts/world.py) runs through the real engine, greedy, under:

  * none           every token's KV kept: the reference, run once (it is the 100% budget);
  * sink_window    StreamingLLM: one page of sinks (sink_tokens 4, rounded up to 16) and
                   window_tokens = B - 16;
  * window_only    sink_window with sink_tokens 0 and window_tokens = B: StreamingLLM's control
                   (a window without sinks), which its paper shows collapsing;
  * heavy_hitter   H2O: window_tokens = B / 1.2 and heavy_ratio 0.2 (B / 6 tokens more, chosen by
                   accumulated attention mass);

for budgets B of 100%, 50%, 20% and 10% of the sequence (the prompt's tokens; a set of
prompts takes the budget of its mean length). Each (policy, budget) is one batched
generate call per workload, the prefix cache flushed before it:

1. accuracy   RAG prompts in the trained format (scripts/world.py _rag: "Document:\\n<town
              document>" blocks, then "Question: ..."), here all eight town documents (~1,390
              tokens): seven that do not hold the answer and the asked person's town document
              either first (early) or last before the question (late); the same questions
              and distractor order for both positions; a person's job, birth year or pet,
              exact match (world.exact_match) on <= 6 greedy tokens. Under none only, three
              controls of the same questions: counterfactual (the late answer document
              states another value: does the model follow the document or its weights?),
              no answer document (the seven distractors only) and closed book (the question
              alone, world.SYSTEM_WORLD, as the answer key asks). NOTE: the demo model follows
              the counterfactual document almost never: it answers from its weights, and the
              documents are context it must not be distracted by. So the early/late figures
              measure how recall survives a long context and what a policy keeps of it, not
              retrieval of a fact that only the document holds (this model has none).
2. perplexity Prompt logprobs (return_logprob, logprob_start_len 0, max_new_tokens 0) of
              world.held_out_text(seed) (held-out facts answered in chat, then held-out sums),
              the first 1,500 tokens of each of --ppl-samples seeds; perplexity =
              exp(mean -logprob) over every token after the first, pooled over the samples. A
              prompt under a policy is prefilled in chunks of at most a quarter of what the
              policy keeps, with drops between them, so its logprobs see the bounded KV.
3. memory     One engine with a --pool-tokens pool (8,192), --requests (16) random prompts of
   and speed  --prompt-len (300) tokens each generating --max-new (700) tokens (greedy,
              ignore_eos), all submitted at once, under none and sink_window (window 256,
              sinks 4) alternately, --rounds times (output tokens/s: the median round).
              KV per request: ceil(seq / 16) pages for none, kv_retention_peak_pages for
              sink_window; "fit pool": how many such requests the pool holds at once;
              concurrency: get_server_info()["running"] polled every 20 ms (common.Poller),
              the most and the mean over the polls while any ran; retractions and recomputed
              tokens: the counters' differences.
4. past the  Prompt logprobs of a 6,144-token held-out text (three times the 2,048-token
   context    context; world.held_out_text of seeds 3000, ...) under each policy with a 512-token
              budget, perplexity per 512-token segment; none reads only the first context's worth.
              This is StreamingLLM's claim: with sinks and re-positioned KV, quality holds past
              the context. (On this 4-layer model the window without sinks holds too: it has
              not learnt to park attention on the first tokens, so the control's collapse,
              measured by StreamingLLM on 7B+ models, does not show here.)

Reading the figures: "d early"/"d late" are accuracy minus none's, "ppl/none" perplexity over
none's, both from the same run. NOTE: on this model a bounded KV can score better than
none: it was trained on rows of 512 packed tokens (only the long tables were longer,
scripts/train_demo_model.py), so ~1,400 tokens of context are themselves a distraction
(the "no answer document" control scores below the closed-book one), and a 10% budget
brings it back to the short contexts it knows. A model trained on long contexts would
show the usual loss; what this one tests is that the policies run, keep what they promise
and free the pool. Likewise window_only need not collapse here: a model whose every row
starts mid-stream (packed) and whose prompts repeat "<|im_start|>" every turn may not
rely on the first tokens as attention sinks.

"kept" is the retained KV actually achieved: kv_retention_peak_pages * 16 over the longest
sequence of the call (page-rounded, so a budget that drops nothing reads a little over
1.00). The peak is a running maximum since the engine started, so each policy has its
own engine and runs its budgets in ascending order; where a call's reading did not rise,
its peak is only known to be at most the reading (peak_pages null, peak_pages_at_most;
"<=N"). "max" is RetentionBudget.max_pages, the bound the scheduler promises (sinks +
window + heavy + the page being filled).

Torch runs --threads intra-op threads in the engines (OMP_NUM_THREADS), 1 by default, for
steadier timings on the shared 2-vCPU machine (bench/prefix_reuse.py explains why).

    .venv/bin/python bench/kv_retention.py [--quick]

Writes bench/results/kv_retention.json and bench/results/kv_retention.png (accuracy vs
budget, early and late; perplexity vs budget; output tokens/s and KV pages per request).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import time
from typing import Any

from common import RESULTS, ROOT, Poller, random_prompts, write_result  # puts scripts/ on sys.path

import world  # noqa: I001 (scripts/world.py: the Vell Valley)


MODEL = ROOT / "assets" / "world-llama"
PAGE = 16
FRACTIONS = (0.1, 0.2, 0.5, 1.0)  # ascending: kv_retention_peak_pages is a running maximum
POLICIES = ("sink_window", "window_only", "heavy_hitter")
ATTRIBUTES = ("job", "born", "pet")  # facts a town document states and a counterfactual can change
ANSWER_TOKENS = 6
PPL_TOKENS = 1500
LONG_TOKENS, LONG_BUDGET, SEGMENT = 6144, 512, 512  # part 4: a text 3x the 2,048-token context


def retention(policy: str, budget: int) -> dict[str, Any]:
    """sampling_params.kv_retention for a budget of `budget` tokens."""
    if policy == "sink_window":
        return {"policy": "sink_window", "sink_tokens": 4, "window_tokens": budget - PAGE}
    if policy == "window_only":
        return {"policy": "sink_window", "sink_tokens": 0, "window_tokens": budget}
    assert policy == "heavy_hitter", policy
    return {"policy": "heavy_hitter", "heavy_ratio": 0.2, "window_tokens": round(budget / 1.2)}


def max_pages(spec: dict[str, Any]) -> int:
    """The scheduler's bound on the request's page table under spec."""
    from radixrt.retention.policies import budget_for
    from radixrt.settings.retention import Retention, RetentionIn

    return budget_for(Retention().with_override(RetentionIn(**spec)), PAGE).max_pages


# -- the workloads -------------------------------------------------------------------------


def rag_prompt(w: dict, towns: list[dict], question: str) -> str:
    """The trained RAG format (world._rag) over these towns' documents, in this order."""
    docs = "".join(f"Document:\n{world.town_document(w, t)}\n\n" for t in towns)
    return world.chat([("system", world.SYSTEM_DOCS), ("user", f"{docs}Question: {question}")])


def rag_items(n: int, seed: int = 0) -> tuple[list[world.Item], list[world.Item]]:
    """(early and late items, the controls) for n seeded (person, attribute) questions.

    Item.subset names the set: early, late, counterfactual, no_answer_doc, closed_book.
    The controls come with counterfactual_memory, the counterfactual prompts scored against
    the world's own value (the model answering from its weights)."""
    w = world.load_world()
    rng = random.Random(seed)
    asked = rng.sample([(p, a) for p in w["people"] for a in ATTRIBUTES], n)
    main, controls = [], []
    for p, attr in asked:
        home = next(t for t in w["towns"] if t["name"] == p["town"])
        others = [t for t in w["towns"] if t is not home]
        rng.shuffle(others)
        question = rng.choice(world.PERSON_QUESTIONS[attr]).format(name=p["name"])
        answer = str(p[attr])
        main.append(world.Item("early", question, answer, rag_prompt(w, [home, *others], question)))
        main.append(world.Item("late", question, answer, rag_prompt(w, [*others, home], question)))
        other = rng.choice(sorted({str(q[attr]) for q in w["people"]} - {answer}))
        changed = dict(p, **{attr: type(p[attr])(other)})
        counter = dict(w, people=[changed if q is p else q for q in w["people"]])
        cf_prompt = rag_prompt(counter, [*others, home], question)
        controls.append(world.Item("counterfactual", question, other, cf_prompt))
        controls.append(world.Item("counterfactual_memory", question, answer, cf_prompt))
        controls.append(world.Item("no_answer_doc", question, answer, rag_prompt(w, others, question)))
        controls.append(world.Item("closed_book", question, answer,
                                   world.chat([("system", world.SYSTEM_WORLD), ("user", question)])))
    return main, controls


def ppl_samples(tokenizer: Any, n: int) -> list[list[int]]:
    """n held-out texts of PPL_TOKENS tokens (world.held_out_text of seeds 2000, 2001, ...)."""
    out = []
    for seed in range(2000, 2000 + n):
        facts, sums, *_ = world.held_out_text(seed)
        ids = tokenizer.encode(facts + sums, add_special_tokens=False)[:PPL_TOKENS]
        assert len(ids) == PPL_TOKENS, len(ids)
        out.append(ids)
    return out


# -- running one configuration ---------------------------------------------------------------


def engine_args(**kw: Any) -> dict[str, Any]:
    return dict(model_path=str(MODEL), page_size=PAGE, log_level="warning", **kw)


class PeakReader:
    """Per call, from the engine's counters: the pages its retention requests peaked at (the running
    maximum after the call, if it rose; else None, the peak being at most the previous reading) and
    the pages they dropped."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.peak, self.dropped = engine, 0, 0
        self.read()

    def read(self) -> tuple[int | None, int, int]:
        """(peak pages or None, the running maximum, pages dropped since the last read)."""
        info = self.engine.get_server_info()
        peak, dropped = info["kv_retention_peak_pages"], info["kv_retention_dropped_pages"]
        result = (peak if peak > self.peak else None), peak, dropped - self.dropped
        self.peak, self.dropped = peak, dropped
        return result


def call(engine: Any, ids: list[list[int]], sampling: dict[str, Any], spec: dict | None, **kw: Any) -> list[dict]:
    assert engine.flush_cache().success
    sp = dict(sampling, kv_retention=spec) if spec is not None else sampling
    return engine.generate(input_ids=ids, sampling_params=sp, **kw)


def budget_row(spec: dict | None, budget: int | None, seq: int, reader: PeakReader) -> dict[str, Any]:
    """The KV figures of the call just made: its budget, the bound, the observed peak and the kept fraction."""
    peak, running_max, dropped = reader.read()
    if spec is None:  # none: every page of the longest sequence
        peak = math.ceil(seq / PAGE)
    return {"retention": spec, "budget_tokens": budget, "max_pages": max_pages(spec) if spec else None,
            "peak_pages": peak, "peak_pages_at_most": running_max if spec and peak is None else None,
            "seq_tokens": seq, "kept": None if peak is None else peak * PAGE / seq, "dropped_pages": dropped}


def run_accuracy(engine: Any, reader: PeakReader, items: list[world.Item], ids: list[list[int]],
                 spec: dict | None, budget: int | None) -> dict[str, Any]:
    t = time.perf_counter()
    outs = call(engine, ids, {"temperature": 0, "max_new_tokens": ANSWER_TOKENS}, spec)
    seq = max(o["meta_info"]["prompt_tokens"] + o["meta_info"]["completion_tokens"] for o in outs)
    acc = world.accuracy(items, [o["text"] for o in outs])
    acc.pop("all")
    return {"accuracy": acc, **budget_row(spec, budget, seq, reader),
            "samples": [(it.subset, it.answer, o["text"]) for it, o in zip(items, outs)][:6],
            "seconds": round(time.perf_counter() - t, 1)}


def run_perplexity(engine: Any, reader: PeakReader, ids: list[list[int]], spec: dict | None,
                   budget: int | None) -> dict[str, Any]:
    t = time.perf_counter()
    outs = call(engine, ids, {"temperature": 0, "max_new_tokens": 0}, spec, return_logprob=True, logprob_start_len=0)
    nll = [[-lp for lp, _, _ in o["meta_info"]["input_token_logprobs"][1:]] for o in outs]  # the first is None
    assert all(len(x) == len(s) - 1 for x, s in zip(nll, ids))
    return {"perplexity": math.exp(sum(map(sum, nll)) / sum(map(len, nll))),
            "per_sample": [math.exp(sum(x) / len(x)) for x in nll],
            **budget_row(spec, budget, max(map(len, ids)), reader), "seconds": round(time.perf_counter() - t, 1)}


def run_quality(items: list[world.Item], controls: list[world.Item], tok: Any, ppl_ids: list[list[int]],
                fractions: tuple[float, ...]) -> dict[str, Any]:
    import radixrt

    encode = lambda its: [tok.encode(it.prompt, add_special_tokens=False) for it in its]  # noqa: E731
    acc_ids, control_ids = encode(items), encode(controls)
    acc_len = statistics.mean(map(len, acc_ids))
    rows: dict[str, Any] = {}
    pool = engine_args(max_total_tokens=1 << 17)
    with radixrt.Engine(**pool) as engine:  # none: the reference, then its controls
        reader = PeakReader(engine)
        rows["none"] = {"accuracy": run_accuracy(engine, reader, items, acc_ids, None, None),
                        "perplexity": run_perplexity(engine, reader, ppl_ids, None, None)}
        rows["controls"] = run_accuracy(engine, reader, controls, control_ids, None, None)
        print("none:", progress(rows["none"]), flush=True)
    for policy in POLICIES:
        rows[policy] = {}
        with radixrt.Engine(**pool) as engine:  # its own engine: a fresh peak counter
            reader = PeakReader(engine)
            for f in fractions:
                a_budget, p_budget = round(f * acc_len), round(f * PPL_TOKENS)
                row = {"accuracy": run_accuracy(engine, reader, items, acc_ids, retention(policy, a_budget), a_budget),
                       "perplexity": run_perplexity(engine, reader, ppl_ids, retention(policy, p_budget), p_budget)}
                rows[policy][f"{f:g}"] = row
                print(f"{policy} {f:.0%}:", progress(row), flush=True)
    return rows


def progress(row: dict) -> str:
    a, p = row["accuracy"], row["perplexity"]
    return (f"early {a['accuracy']['early']:.2f} late {a['accuracy']['late']:.2f} ({a['seconds']}s), "
            f"ppl {p['perplexity']:.3f} ({p['seconds']}s), kept {a['kept']}, {p['kept']}")


# -- past the context ----------------------------------------------------------------------------


def long_text(tokenizer: Any) -> list[int]:
    """LONG_TOKENS held-out tokens: world.held_out_text of seeds 3000, 3001, ... one after another."""
    ids: list[int] = []
    seed = 3000
    while len(ids) < LONG_TOKENS:
        facts, sums, *_ = world.held_out_text(seed)
        ids += tokenizer.encode(facts + sums, add_special_tokens=False)
        seed += 1
    return ids[:LONG_TOKENS]


def segment_ppl(nll: list[float]) -> list[float]:
    """Perplexity of each SEGMENT-token stretch of per-token negative logprobs."""
    return [math.exp(statistics.mean(nll[i : i + SEGMENT])) for i in range(0, len(nll) - SEGMENT + 1, SEGMENT)]


def run_past_context(tok: Any) -> dict[str, Any]:
    """Prompt perplexity of a text three times the context, per 512-token segment, under each policy
    with a 512-token budget; none can only read the first context's worth (its reference)."""
    import radixrt

    ids = long_text(tok)
    rows: dict[str, Any] = {}
    with radixrt.Engine(**engine_args(max_total_tokens=1 << 15)) as engine:
        context = engine.get_server_info()["context_length"]
        for name, spec, n in [("none", None, context - 1)] + [(p, retention(p, LONG_BUDGET), LONG_TOKENS)
                                                               for p in POLICIES]:
            t = time.perf_counter()
            (out,) = call(engine, [ids[:n]], {"temperature": 0, "max_new_tokens": 0}, spec,
                          return_logprob=True, logprob_start_len=0)
            nll = [-lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
            rows[name] = {"retention": spec, "tokens": n, "segment_ppl": segment_ppl(nll),
                          "ppl_past_context": math.exp(statistics.mean(nll[context:])) if n > context else None,
                          "seconds": round(time.perf_counter() - t, 1)}
            print(f"past the context, {name}: {' '.join(f'{x:.2f}' for x in rows[name]['segment_ppl'])}", flush=True)
    return {"tokens": LONG_TOKENS, "budget_tokens": LONG_BUDGET, "segment": SEGMENT, "context": context,
            "policies": rows}


def print_past_context(pc: dict) -> None:
    print(f"\n-- 4. past the context: {pc['tokens']} held-out tokens ({pc['context']}-token context), budget "
          f"{pc['budget_tokens']} tokens; perplexity per {pc['segment']}-token segment (none: the first context only)")
    for name, r in pc["policies"].items():
        past = "-" if r["ppl_past_context"] is None else f"{r['ppl_past_context']:.3f}"
        print(f"{name:13s} past the context {past:>7s} | " + " ".join(f"{x:5.2f}" for x in r["segment_ppl"]))


# -- memory and throughput at a fixed pool ------------------------------------------------------


def throughput_round(engine: Any, prompts: list[list[int]], sampling: dict, spec: dict | None) -> dict[str, Any]:
    """Every prompt submitted at once under spec: wall time, output tokens, concurrency, retractions."""
    before = engine.get_server_info()
    with Poller(engine.get_server_info, "running", 0.02) as running:
        start = time.perf_counter()
        outs = call(engine, prompts, sampling, spec)
        wall = time.perf_counter() - start
    after = engine.get_server_info()
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall, "max_running": running.peak,
            "mean_running": running.busy_mean, "polls": running.samples,
            **{k: after[k] - before[k] for k in ("retractions", "recomputed_tokens")}}


def throughput_row(rounds: list[dict], spec: dict | None, pages: int, pool_tokens: int, want: int) -> dict[str, Any]:
    """One policy's rounds summed up: median output tokens/s, KV per request, concurrency."""
    tok_s = sorted(r["tok_s"] for r in rounds)
    return {"retention": spec, "output_tok_s": statistics.median(tok_s), "output_tok_s_min": tok_s[0],
            "output_tok_s_max": tok_s[-1], "pages_per_request": pages, "kv_tokens_per_request": pages * PAGE,
            "max_pages": max_pages(spec) if spec else None, "requests_fitting_pool": pool_tokens // (pages * PAGE),
            "max_running": max(r["max_running"] for r in rounds),
            "mean_running": statistics.median(r["mean_running"] for r in rounds),
            "retractions": sum(r["retractions"] for r in rounds),
            "recomputed_tokens": sum(r["recomputed_tokens"] for r in rounds),
            "all_completed": all(r["output_tokens"] == want for r in rounds), "rounds": rounds}


def run_throughput(args: argparse.Namespace) -> dict[str, Any]:
    import radixrt

    prompts = random_prompts(args.requests, args.prompt_len, args.prompt_len, vocab=2000, seed=3)
    sampling = {"max_new_tokens": args.max_new, "temperature": 0, "ignore_eos": True}
    specs = {"none": None, "sink_window": {"policy": "sink_window", "sink_tokens": 4, "window_tokens": args.window}}
    rounds: dict[str, list[dict]] = {k: [] for k in specs}
    with radixrt.Engine(**engine_args(max_total_tokens=args.pool_tokens)) as engine:
        engine.generate(input_ids=[list(range(3, 40))], sampling_params={"max_new_tokens": 4})  # warm-up
        for _ in range(args.rounds):
            for name, spec in specs.items():  # alternately: the shared machine's noise falls on both
                rounds[name].append(throughput_round(engine, prompts, sampling, spec))
        info = engine.get_server_info()
    pages = {"none": math.ceil((args.prompt_len + args.max_new) / PAGE),
             "sink_window": info["kv_retention_peak_pages"]}  # only sink_window's requests count
    pool_tokens = info["num_pages"] * PAGE
    rows = {name: throughput_row(rounds[name], spec, pages[name], pool_tokens, args.requests * args.max_new)
            for name, spec in specs.items()}
    sw, none = rows["sink_window"], rows["none"]
    sw.update(tok_s_vs_none=sw["output_tok_s"] / none["output_tok_s"],
              pages_vs_none=sw["pages_per_request"] / none["pages_per_request"])
    return {"pool_tokens": pool_tokens, "requests": args.requests, "prompt_len": args.prompt_len,
            "max_new_tokens": args.max_new, "rounds": args.rounds, "policies": rows}


# -- reporting ---------------------------------------------------------------------------------


def ratios(quality: dict) -> None:
    """Each policy row against none of the same run: accuracy differences, perplexity ratios."""
    none_acc, none_ppl = quality["none"]["accuracy"]["accuracy"], quality["none"]["perplexity"]["perplexity"]
    for policy in POLICIES:
        for row in quality[policy].values():
            row["accuracy"]["vs_none"] = {k: v - none_acc[k] for k, v in row["accuracy"]["accuracy"].items()}
            row["perplexity"]["vs_none"] = row["perplexity"]["perplexity"] / none_ppl


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def pages(r: dict) -> str:
    """peak/max pages; "<=N" where the running maximum did not rise (the call peaked at most there)."""
    peak = f"<={r['peak_pages_at_most']}" if r["peak_pages_at_most"] is not None else fmt(r["peak_pages"], "d")
    return f"{peak:>5s}/{fmt(r['max_pages'], 'd'):<4s}"


def print_quality(q: dict, n: int) -> None:
    print(f"\n-- 1. accuracy: {n} questions per answer position, 8 documents (<= {q['none']['accuracy']['seq_tokens']} "
          f"tokens with the answer), exact match; 2. perplexity: {len(q['none']['perplexity']['per_sample'])} x "
          f"{PPL_TOKENS} held-out tokens. d: minus none; kept: peak pages x {PAGE} / sequence tokens")
    print(f"{'':20s} | {'1. accuracy':^65s} | {'2. perplexity':^50s}")
    print(f"{'policy':13s} {'budget':>6s} | {'B tok':>5s} {'peak/max pg':>10s} {'kept':>5s} {'dropped':>7s} {'early':>6s}"
          f" {'late':>6s} {'d early':>7s} {'d late':>7s} | {'B tok':>5s} {'peak/max pg':>10s} {'kept':>5s} {'dropped':>7s}"
          f" {'ppl':>7s} {'ppl/none':>8s}")
    rows = [("none", "100%", q["none"])] + [(p, f"{float(f):.0%}", r) for p in POLICIES for f, r in q[p].items()]
    for policy, budget, r in rows:
        a, p = r["accuracy"], r["perplexity"]
        d = a.get("vs_none", {"early": 0.0, "late": 0.0})
        print(f"{policy:13s} {budget:>6s} | {fmt(a['budget_tokens'], '5d'):>5s} {pages(a):>11s} {fmt(a['kept'], '5.2f'):>5s}"
              f" {a['dropped_pages']:7d} {a['accuracy']['early']:6.3f} {a['accuracy']['late']:6.3f} {d['early']:+7.3f}"
              f" {d['late']:+7.3f} | {fmt(p['budget_tokens'], '5d'):>5s} {pages(p):>11s} {fmt(p['kept'], '5.2f'):>5s}"
              f" {p['dropped_pages']:7d} {p['perplexity']:7.3f} {p.get('vs_none', 1.0):8.3f}")
    c = q["controls"]["accuracy"]
    print(f"controls under none (same questions): counterfactual late document followed {c['counterfactual']:.3f}, "
          f"answered from the weights instead {c['counterfactual_memory']:.3f}; no answer document {c['no_answer_doc']:.3f}; "
          f"closed book (question alone) {c['closed_book']:.3f}")


def print_throughput(t: dict) -> None:
    print(f"\n-- 3. memory and throughput: pool {t['pool_tokens']} tokens; {t['requests']} requests x {t['prompt_len']} "
          f"prompt + {t['max_new_tokens']} output tokens, all at once, greedy; median of {t['rounds']} round(s)")
    print(f"{'policy':12s} {'out tok/s':>9s} {'(min-max)':>11s} {'vs none':>7s} {'pages/req':>9s} {'KV tok/req':>10s}"
          f" {'fit pool':>8s} {'max run':>7s} {'mean run':>8s} {'retract':>7s} {'recomputed':>10s}")
    none = t["policies"]["none"]["output_tok_s"]
    for name, r in t["policies"].items():
        print(f"{name:12s} {r['output_tok_s']:9.1f} {r['output_tok_s_min']:5.0f}-{r['output_tok_s_max']:<5.0f}"
              f" {r['output_tok_s'] / none:6.2f}x {r['pages_per_request']:9d} {r['kv_tokens_per_request']:10d}"
              f" {r['requests_fitting_pool']:8d} {r['max_running']:7d} {r['mean_running']:8.1f} {r['retractions']:7d}"
              f" {r['recomputed_tokens']:10d}")
    if not all(r["all_completed"] for r in t["policies"].values()):
        print("!! some requests did not produce all their output tokens")


def plot(q: dict, t: dict, pc: dict, path: Any) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 6, figsize=(26, 4.2))
    colors = {"sink_window": "C0", "window_only": "C3", "heavy_hitter": "C2", "none": "k"}
    styles = {"sink_window": "o-", "window_only": "s--", "heavy_hitter": "^:"}  # lines that coincide stay visible
    for ax, (kind, key, label) in zip(axes[:3], [("accuracy", "early", "accuracy, answer document first"),
                                                 ("accuracy", "late", "accuracy, answer document last"),
                                                 ("perplexity", None, "held-out perplexity")]):
        value = (lambda r: r[kind]["accuracy"][key]) if key else (lambda r: r[kind]["perplexity"])
        for policy in POLICIES:
            xs = [100 * float(f) for f in q[policy]]
            ax.plot(xs, [value(r) for r in q[policy].values()], styles[policy], color=colors[policy], label=policy,
                    markersize=7 if policy == "sink_window" else 5)
        ax.axhline(value(q["none"]), color="k", ls="--", lw=1, label="none (all KV)")
        if kind == "accuracy":
            ax.axhline(q["controls"]["accuracy"]["closed_book"], color="gray", ls=":", lw=1,
                       label="none, question alone (closed book)")
        ax.set_xscale("log")
        ax.set_xticks([10, 20, 50, 100], ["10%", "20%", "50%", "100%"])
        ax.set_xlabel("KV budget (share of the sequence)")
        ax.set_title(label)
        ax.grid(alpha=0.3)
        if kind == "accuracy":
            ax.set_ylim(0, 1.02)
    axes[0].legend(fontsize=8)
    names = list(t["policies"])
    bar_colors = [colors[n] for n in names]
    axes[3].bar(names, [t["policies"][n]["output_tok_s"] for n in names], color=bar_colors)
    axes[3].set_title(f"output tok/s, pool {t['pool_tokens']} tokens, {t['requests']} requests")
    axes[4].bar(names, [t["policies"][n]["kv_tokens_per_request"] for n in names], color=bar_colors)
    axes[4].set_title(f"KV tokens per request ({t['prompt_len']} + {t['max_new_tokens']} tokens)")
    for policy, r in pc["policies"].items():
        xs = [pc["segment"] * (i + 1) for i in range(len(r["segment_ppl"]))]
        axes[5].plot(xs, r["segment_ppl"], styles.get(policy, "-"), color=colors[policy], label=policy)
    axes[5].axvline(pc["context"], color="gray", ls=":", lw=1)
    axes[5].set_title(f"perplexity past the context (budget {pc['budget_tokens']})")
    axes[5].set_xlabel("tokens into the text")
    axes[5].legend(fontsize=8)
    axes[5].grid(alpha=0.3)
    fig.suptitle("bounded-KV retention on world-llama (CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a smoke run: few items, budgets 100%% and 10%%, short generations")
    p.add_argument("--questions", type=int, default=30, help="questions per answer position")
    p.add_argument("--ppl-samples", type=int, default=3, help=f"held-out texts of {PPL_TOKENS} tokens")
    p.add_argument("--pool-tokens", type=int, default=8192, help="(throughput) the KV pool")
    p.add_argument("--requests", type=int, default=16, help="(throughput) concurrent requests")
    p.add_argument("--prompt-len", type=int, default=300, help="(throughput) prompt tokens per request")
    p.add_argument("--max-new", type=int, default=700, help="(throughput) output tokens per request")
    p.add_argument("--window", type=int, default=256, help="(throughput) sink_window's window_tokens")
    p.add_argument("--rounds", type=int, default=3, help="(throughput) rounds per policy (median)")
    p.add_argument("--threads", type=int, default=1, help="torch threads in the engines (OMP_NUM_THREADS)")
    args = p.parse_args()
    if args.quick:
        args.questions, args.ppl_samples, args.requests, args.max_new, args.rounds = 4, 1, 8, 200, 1
    return args


def main() -> None:
    args = parse_args()
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # read by torch in the spawned engines
    import torch
    from transformers import AutoTokenizer

    start = time.perf_counter()
    fractions = (0.1, 1.0) if args.quick else FRACTIONS
    tok = AutoTokenizer.from_pretrained(MODEL)
    items, controls = rag_items(args.questions)
    print(f"== world-llama, page size {PAGE}, {args.threads} torch thread(s), budgets {[f'{f:.0%}' for f in fractions]}")
    print("NOTE: the machine is shared with other jobs: timings are noisy, ratios within a part are the figure to read")
    quality = run_quality(items, controls, tok, ppl_samples(tok, args.ppl_samples), fractions)
    ratios(quality)
    past = run_past_context(tok)
    throughput = run_throughput(args)
    print_quality(quality, args.questions)
    print_throughput(throughput)
    print_past_context(past)
    wall = time.perf_counter() - start
    print(f"\nwall time {wall:.0f} s")
    config = {k: v for k, v in vars(args).items()} | {"fractions": fractions, "page_size": PAGE,
                                                        "answer_tokens": ANSWER_TOKENS, "ppl_tokens": PPL_TOKENS}
    name = "kv_retention_quick" if args.quick else "kv_retention"
    print("wrote", write_result(name, {"model": str(MODEL.relative_to(ROOT)), "torch": torch.__version__,
                                       "config": config, "wall_s": round(wall, 1), "quality": quality,
                                       "past_context": past, "throughput": throughput}))
    plot(quality, throughput, past, RESULTS / f"{name}.png")
    print("wrote", RESULTS / f"{name}.png")


if __name__ == "__main__":
    main()

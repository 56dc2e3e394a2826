"""Quality regression of weight x KV quantization on a real trained model, SmolLM2-135M-Instruct.

The fixed item set (bench/data/quant_quality_set.json, built by `--build-set` from bench/quality_set.py's
candidates: those the bf16 model answers right, greedy) runs through the real engine for every combination of

  weights  bf16 (the bf16 checkpoint as it is), w8a8_int8 (quantization="w8a8_int8"),
           int8wo (torchao_config="int8wo"), int4wo-32 / int4wo-128 (torchao_config), gguf (the Q4_1 .gguf file
           itself, dtype bfloat16, its layers held quantized), gguf-Q4_0 / -Q8_0 / -Q4_K_M (the files
           scripts/make_gguf_variants.py writes beside it; unavailable where not made)
  KV       auto, int8, fp8_e4m3, fp8_e5m2, int4 (rotated keys), int4-unrotated (kv_cache_rotation off),
           int8:int4 (int8 keys, int4 values) (kv_cache_dtype; the start-up check keeps its default threshold)

A combination whose engine does not start is reported as "unavailable: <error>" (a weight option not
implemented yet, or the KV start-up check refusing the pool) and the run goes on. Per combination:

  * accuracy per category and overall, and format stability (replies in the asked format: code compiles,
    JSON parses as an object, a text reply ends on its own before max_new_tokens);
  * request latency (mean, P95: meta_info e2e_latency, every item submitted at once in one generate call,
    so it includes queueing), output tok/s (completion tokens / the call's wall time);
  * memory: the peak RSS (VmHWM) of the engine's processes summed, read after the generate call (start-up and
    serving; the logprob runs after it would dominate it with full-vocabulary prompt logits), and the engine's
    own figures (worker RSS peak, KV pool and weight bytes, CUDA peak);
  * perplexity of held-out stdlib text (prompt logprobs, logprob_start_len=0);
  * against bf16 + auto (always run first, as the reference): bf16's greedy replies are teacher-forced
    through this combination (prompt + reply as input_ids, prompt logprobs from the reply's first token,
    top_logprobs_num=1). top-1 agreement: the fraction of reply positions where this combination's argmax
    equals the reference's teacher-forced argmax at the same prefix; max |dlogprob|: the largest difference
    of the reply token's logprob between the two.

    .venv/bin/python bench/quant_quality.py [--quick] [--weights bf16,gguf] [--kv auto,int8]
    .venv/bin/python bench/quant_quality.py --build-set      # rebuild the fixed set (bf16 + auto)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import quality_set as qs
from common import RESULTS, ROOT, write_result  # puts scripts/ on sys.path
from make_smollm2 import ensure_smollm2  # scripts/, on sys.path once common is imported

SET_PATH = ROOT / "bench" / "data" / "quant_quality_set.json"
WEIGHTS = ("bf16", "w8a8_int8", "int8wo", "int4wo-32", "int4wo-128", "gguf", "gguf-Q4_0", "gguf-Q8_0", "gguf-Q4_K_M")
KV_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2", "int4", "int4-unrotated", "int8:int4")
# KV columns that are not a kv_cache_dtype alone: their engine arguments
KV_ARGS = {"int4-unrotated": {"kv_cache_dtype": "int4", "kv_cache_rotation": "off"}}
REFERENCE = "bf16+auto"
BASE_ARGS = {"max_total_tokens": 32768}  # the same KV pool (in tokens) for every combination
PER_CATEGORY, MIN_PER_CATEGORY = 40, 20  # the set keeps up to 40 passing items a category; under 20 it is failed
QUICK_ITEMS, QUICK_PASSAGES = 4, 2
PASSAGE_TOKENS = 512


@dataclass(frozen=True)
class Combo:
    weights: str
    kv: str

    @property
    def name(self) -> str:
        return f"{self.weights}+{self.kv}"

    def engine_args(self, extra: dict[str, Any]) -> dict[str, Any]:
        model = ensure_smollm2()
        weights = {"bf16": {"model_path": str(model.hf_dir)},
                   "w8a8_int8": {"model_path": str(model.hf_dir), "quantization": "w8a8_int8"},
                   "int8wo": {"model_path": str(model.hf_dir), "torchao_config": "int8wo"},
                   "gguf": {"model_path": str(model.gguf), "dtype": "bfloat16"}}
        weights |= {f"int4wo-{g}": {"model_path": str(model.hf_dir), "torchao_config": f"int4wo-{g}"} for g in (32, 128)}
        weights |= {f"gguf-{t}": {"model_path": str(model.gguf.parent / "variants" / f"{t}.gguf"), "dtype": "bfloat16"}
                    for t in ("Q4_0", "Q8_0", "Q4_K_M")}
        weights = weights[self.weights]
        return {**BASE_ARGS, **extra, **weights, **KV_ARGS.get(self.kv, {"kv_cache_dtype": self.kv})}


@dataclass(frozen=True)
class Reply:
    text: str
    output_ids: list[int]
    finished: bool  # ended on a stop token, not at max_new_tokens
    latency_s: float


@dataclass(frozen=True)
class Forced:
    """One teacher-forced reply: per position, the logprob of the forced token and the argmax token."""

    logprobs: list[float]
    top1: list[int]


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def generate(engine: Any, items: list[qs.Item], prompts: list[list[int]]) -> tuple[list[Reply], float]:
    """Every item's greedy reply, all in one generate call; and the call's wall time."""
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=[
        {"temperature": 0, "max_new_tokens": it.max_new_tokens} for it in items])
    wall = time.perf_counter() - start
    return [Reply(o["text"], o["output_ids"], o["meta_info"]["finish_reason"]["type"] == "stop",
                  o["meta_info"]["e2e_latency"]) for o in outs], wall


def teacher_force(engine: Any, prompts: list[list[int]], replies: list[list[int]]) -> list[Forced]:
    """Each prompt + reply run as a prompt; the reply positions' logprobs and argmax tokens."""
    outs = engine.generate(input_ids=[p + r for p, r in zip(prompts, replies)],
                           sampling_params={"temperature": 0, "max_new_tokens": 1}, return_logprob=True,
                           logprob_start_len=[len(p) for p in prompts], top_logprobs_num=1)
    return [Forced([lp for lp, _, _ in o["meta_info"]["input_token_logprobs"]],
                   [top[0][1] for top in o["meta_info"]["input_top_logprobs"]]) for o in outs]


def perplexity(engine: Any, passages: list[list[int]]) -> float:
    outs = engine.generate(input_ids=passages, sampling_params={"temperature": 0, "max_new_tokens": 1},
                           return_logprob=True, logprob_start_len=0)
    lps = [lp for o in outs for lp, _, _ in o["meta_info"]["input_token_logprobs"] if lp is not None]
    return math.exp(-sum(lps) / len(lps))


def compare(forced: list[Forced], ref: list[Forced], ref_ids: list[list[int]]) -> dict[str, float]:
    """Teacher-forced agreement with the reference over every reply position. greedy_agreement: argmax equal to
    the reference's greedy token (for the reference itself: how often prefill and decode pick alike)."""
    pairs = [(a, b) for f, r in zip(forced, ref) for a, b in zip(zip(f.top1, f.logprobs), zip(r.top1, r.logprobs))]
    deltas = [abs(a[1] - b[1]) for a, b in pairs]
    greedy = [a == b for f, ids in zip(forced, ref_ids) for a, b in zip(f.top1, ids)]
    return {"top1_agreement": sum(a[0] == b[0] for a, b in pairs) / len(pairs), "max_abs_dlogprob": max(deltas),
            "mean_abs_dlogprob": statistics.mean(deltas), "greedy_agreement": sum(greedy) / len(greedy),
            "positions": len(pairs)}


def _status_bytes(pid: int, field: str) -> int:
    """A 'Field:  N kB' line of /proc/PID/status in bytes (0 where /proc cannot tell)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def memory(engine: Any) -> dict[str, int]:
    """The engine processes' peak RSS so far (VmHWM summed: an upper bound on their joint peak; it includes start-up
    transients such as the KV check's reference pool) and their RSS now, and the engine's own figures."""
    info = engine.get_server_info()
    keys = ("worker_rss_peak_bytes", "worker_rss_bytes", "kv_pool_bytes", "weight_bytes", "device_memory_peak_bytes")
    return {"engine_rss_peak_bytes": sum(_status_bytes(p, "VmHWM") for p in engine.pids),
            "engine_rss_now_bytes": sum(_status_bytes(p, "VmRSS") for p in engine.pids), **{k: info.get(k) for k in keys}}


def grade(items: list[qs.Item], replies: list[Reply]) -> dict[str, Any]:
    verdicts = [qs.check(it, r.text, r.finished) for it, r in zip(items, replies)]
    cats = sorted({it.category for it in items}, key=qs.CATEGORIES.index)

    def rate(attr: str, cat: str | None) -> float:
        vs = [v for it, v in zip(items, verdicts) if cat is None or it.category == cat]
        return sum(getattr(v, attr) for v in vs) / len(vs)

    return {"accuracy": {**{c: rate("correct", c) for c in cats}, "overall": rate("correct", None)},
            "format_stability": {**{c: rate("well_formed", c) for c in cats}, "overall": rate("well_formed", None)},
            "failed_ids": [it.id for it, v in zip(items, verdicts) if not v.correct],
            "failed_examples": dict([(it.id, r.text[:160]) for it, r, v in zip(items, replies, verdicts)
                                     if not v.correct][:10])}  # the first 10, for spot checks


def speed(replies: list[Reply], wall: float) -> dict[str, float]:
    lat = sorted(r.latency_s for r in replies)
    return {"latency_mean_s": statistics.mean(lat), "latency_p95_s": lat[min(len(lat) - 1, int(0.95 * len(lat)))],
            "output_tok_per_s": sum(len(r.output_ids) for r in replies) / wall, "generate_wall_s": wall}


def run_combo(combo: Combo, data: dict[str, Any], extra: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    """One combination's figures; `ref` (the reference's replies and teacher-forced run) is None for the reference."""
    import radixrt

    t0 = time.perf_counter()
    try:
        engine = radixrt.Engine(**combo.engine_args(extra))
    except Exception as e:  # noqa: BLE001 (any start-up failure is a result: report it and go on)
        return {"status": f"unavailable: {type(e).__name__}: {e}", "startup_s": time.perf_counter() - t0}
    row: dict[str, Any] = {"status": "ok", "startup_s": time.perf_counter() - t0}
    try:
        engine.generate(input_ids=data["prompts"][:4], sampling_params={"temperature": 0, "max_new_tokens": 8})  # warm-up
        replies, wall = generate(engine, data["items"], data["prompts"])
        row |= grade(data["items"], replies) | speed(replies, wall)
        # NOTE: before the logprob runs: their full-vocabulary prompt logits (chunk x 49,152 floats) would set the peak
        row["memory"] = memory(engine)
        t = time.perf_counter()
        ref_ids = [r.output_ids for r in (ref or {"replies": replies})["replies"]]
        forced = teacher_force(engine, data["prompts"], ref_ids)
        row["perplexity"] = perplexity(engine, data["passages"])
        row["logprob_s"] = time.perf_counter() - t
        row["vs_reference"] = compare(forced, ref["forced"] if ref else forced, ref_ids)
        row["_replies"], row["_forced"] = replies, forced
    except Exception as e:  # noqa: BLE001 (a combination that dies mid-run is reported, not fatal)
        row["status"] = f"failed: {type(e).__name__}: {e}"
    finally:
        engine.shutdown()
    row["wall_s"] = time.perf_counter() - t0
    return row


def load_set(tokenizer: Any, quick: bool, path: Path = SET_PATH) -> dict[str, Any]:
    """The fixed set's items (a few per category with quick), their prompt ids and the held-out passages' ids."""
    saved = json.loads(path.read_text())
    items = [qs.Item.of(d) for d in saved["items"]]
    if quick:
        items = [it for c in qs.CATEGORIES for it in [x for x in items if x.category == c][:QUICK_ITEMS]]
    passages = saved["held_out"][:QUICK_PASSAGES] if quick else saved["held_out"]
    encode = [tokenizer.encode(p["text"], add_special_tokens=False)[:PASSAGE_TOKENS] for p in passages]
    return {"items": items, "prompts": [chat_ids(tokenizer, it.messages) for it in items], "passages": encode,
            "counts": {c: sum(it.category == c for it in items) for c in qs.CATEGORIES}}


def build_set(tokenizer: Any, extra: dict[str, Any]) -> None:
    """Run every candidate through bf16 + auto; keep up to PER_CATEGORY passing items a category (round-robin
    over templates); a category with fewer than MIN_PER_CATEGORY passing is recorded as failed, with no items."""
    import radixrt

    cands = [it for items in qs.candidates().values() for it in items]
    prompts = [chat_ids(tokenizer, it.messages) for it in cands]
    with radixrt.Engine(**Combo("bf16", "auto").engine_args(extra)) as engine:
        replies, wall = generate(engine, cands, prompts)
    passed = {it.id: qs.check(it, r.text, r.finished).correct for it, r in zip(cands, replies)}
    text = {it.id: r.text for it, r in zip(cands, replies)}
    kept, categories = [], {}
    for cat in qs.CATEGORIES:
        mine = [it for it in cands if it.category == cat]
        good = [it for it in mine if passed[it.id]]
        ok = len(good) >= MIN_PER_CATEGORY
        chosen = qs.round_robin(good, PER_CATEGORY) if ok else []
        kept += [it.to_dict() | {"ref_text": text[it.id]} for it in chosen]
        categories[cat] = {"candidates": len(mine), "passed": len(good), "pass_rate": len(good) / len(mine),
                           "kept": len(chosen), "status": "ok" if ok else f"failed: under {MIN_PER_CATEGORY} pass",
                           **({} if ok else {"passed_ids": [it.id for it in good], "examples": {
                               it.id: text[it.id][:200] for it in mine[:6]}})}
        print(f"{cat:12s} {len(good):3d}/{len(mine):3d} pass, kept {len(chosen)}")
    SET_PATH.parent.mkdir(parents=True, exist_ok=True)
    SET_PATH.write_text(json.dumps({
        "model": "SmolLM2-135M-Instruct (models/smollm2-0.1.2/hf, bf16), chat template, greedy",
        "built_with": {"engine_args": {**BASE_ARGS, **extra, "kv_cache_dtype": "auto"}, "candidates_wall_s": wall,
                       "when": time.strftime("%Y-%m-%d %H:%M")},
        "categories": categories, "items": kept, "held_out": qs.held_out_texts()}, indent=1))
    print("wrote", SET_PATH, f"({SET_PATH.stat().st_size / 1e6:.2f} MB)")


def print_table(rows: dict[str, dict[str, Any]], counts: dict[str, int]) -> None:
    cats = [c for c in qs.CATEGORIES if counts.get(c)]
    print("\nitems: " + ", ".join(f"{c} {counts[c]}" for c in cats))
    head = (f"{'weights+kv':19s}" + "".join(f"{c[:8]:>9s}" for c in cats) + f"{'overall':>9s}{'format':>8s}"
            f"{'ppl':>8s}{'top-1':>7s}{'max|dlp|':>9s}{'lat ms':>8s}{'p95 ms':>8s}{'tok/s':>7s}{'RSS MB':>8s}{'wall s':>8s}")
    print(head)
    for name, r in rows.items():
        if r["status"] != "ok":
            print(f"{name:19s} {r['status'][:150]}")
            continue
        acc, vs = r["accuracy"], r["vs_reference"]
        print(f"{name:19s}" + "".join(f"{acc[c]:9.3f}" for c in cats) + f"{acc['overall']:9.3f}"
              f"{r['format_stability']['overall']:8.3f}{r['perplexity']:8.3f}{vs['top1_agreement']:7.3f}"
              f"{vs['max_abs_dlogprob']:9.3f}{1e3 * r['latency_mean_s']:8.0f}{1e3 * r['latency_p95_s']:8.0f}"
              f"{r['output_tok_per_s']:7.1f}{r['memory']['engine_rss_peak_bytes'] / 2**20:8.0f}{r['wall_s']:8.0f}")


def plot(rows: dict[str, dict[str, Any]], path: Path) -> None:
    """Overall accuracy and top-1 agreement as weights x KV grids; a combination that did not run is blank."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (title, get) in zip(axes, [("overall accuracy", lambda r: r["accuracy"]["overall"]),
                                       ("top-1 agreement with bf16+auto", lambda r: r["vs_reference"]["top1_agreement"])]):
        grid = np.full((len(WEIGHTS), len(KV_DTYPES)), np.nan)
        for i, w in enumerate(WEIGHTS):
            for j, kv in enumerate(KV_DTYPES):
                r = rows.get(f"{w}+{kv}")
                if r and r["status"] == "ok":
                    grid[i, j] = get(r)
                label = f"{grid[i, j]:.3f}" if r and r["status"] == "ok" else (r["status"].split(":")[0] if r else "not run")
                ax.text(j, i, label, ha="center", va="center", fontsize=9)
        low = min(0.8, float(np.nanmin(grid))) if np.isfinite(grid).any() else 0.8
        ax.imshow(grid, cmap="RdYlGn", vmin=low, vmax=1)
        ax.set(title=title, xticks=range(len(KV_DTYPES)), xticklabels=KV_DTYPES, yticks=range(len(WEIGHTS)),
               yticklabels=WEIGHTS, xlabel="kv_cache_dtype", ylabel="weights")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _select(names: str, known: tuple[str, ...]) -> list[str]:
    picked = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in picked if n not in known]
    if unknown:
        raise SystemExit(f"unknown {unknown}; choose from {', '.join(known)}")
    return picked


def save(name: str, data: dict[str, Any], extra: dict[str, Any], rows: dict[str, dict[str, Any]]) -> None:
    """Merge rows into bench/results/NAME.json (other combinations keep their earlier figures) and redraw NAME.png."""
    path = RESULTS / f"{name}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    merged = old.get("combinations") or old.get("results") or {}  # "results": a hand-assembled earlier file
    merged |= {k: {f: v for f, v in r.items() if not f.startswith("_")} for k, r in rows.items()}
    workload = (f"bench/data/quant_quality_set.json ({data['counts']}), greedy, one generate call per combination; "
                f"{len(data['passages'])} held-out passages of <= {PASSAGE_TOKENS} tokens for perplexity")
    write_result(name, {"model": "SmolLM2-135M-Instruct", "workload": workload, "engine_args": {**BASE_ARGS, **extra},
                        "combinations": merged})
    plot(merged, RESULTS / f"{name}.png")


def run(args: argparse.Namespace, tokenizer: Any, extra: dict[str, Any]) -> None:
    """The chosen combinations, the reference first; results are saved after each, so an interrupted run keeps them."""
    data = load_set(tokenizer, args.quick)
    combos = [Combo(w, kv) for w in _select(args.weights, WEIGHTS) for kv in _select(args.kv, KV_DTYPES)]
    combos = [Combo("bf16", "auto")] + [c for c in combos if c.name != REFERENCE]
    name = "quant_quality_quick" if args.quick else "quant_quality"
    rows: dict[str, dict[str, Any]] = {}
    ref = None
    for combo in combos:
        print(f"== {combo.name}", flush=True)
        row = rows[combo.name] = run_combo(combo, data, extra, ref)
        if combo.name == REFERENCE and row["status"] == "ok":
            ref = {"replies": row["_replies"], "forced": row["_forced"]}
        save(name, data, extra, {combo.name: row})
        print({k: v for k, v in row.items() if not k.startswith("_") and "failed" not in k}, flush=True)
    print_table(rows, data["counts"])
    print(f"\nwrote {RESULTS / name}.json and .png")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_ITEMS} items a category, {QUICK_PASSAGES} passages")
    p.add_argument("--weights", default=",".join(WEIGHTS), help="comma-separated subset of " + ", ".join(WEIGHTS))
    p.add_argument("--kv", default=",".join(KV_DTYPES), help="comma-separated subset of " + ", ".join(KV_DTYPES))
    p.add_argument("--kv-min-agreement", type=float, help="kv_quant_min_agreement (default: the engine's)")
    p.add_argument("--build-set", action="store_true", help="rebuild bench/data/quant_quality_set.json and stop")
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2().hf_dir)
    extra = {} if args.kv_min_agreement is None else {"kv_quant_min_agreement": args.kv_min_agreement}
    if args.build_set:
        build_set(tokenizer, extra)
    else:
        run(args, tokenizer, extra)


if __name__ == "__main__":
    main()

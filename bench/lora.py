"""Multi-LoRA serving on the peers' `small` llama (88M): N adapters mixed in one batch, against
the base model alone and against one merged checkpoint per adapter.

Workloads: /work/shared/peers/workloads.py's W2_unique (200..800-token unrelated prompts, 64 out)
and W3_multiturn (conversations x 4 turns, 32 out per turn), cut to --w2-prompts prompts and
--w3-convs conversations to keep the run short. Greedy, EOS ignored, bfloat16, page 16, prompts as
token ids, the radix cache flushed before every run, one warm-up generate per engine (as
bench_radixrt.py does). Request i (W3: conversation i, every turn) uses adapter i % N.

For each N in --counts (1, 4, 16), with random PEFT adapters of rank --rank on all 7 projections
(tests/support/lora_adapters.py, seeds SEED0 + k, so adapter k is the same for every N):
  base    one Engine without LoRA, the same requests (measured once; N does not change it)
  lora    one Engine with the N adapters loaded (max_loaded_loras N, max_loras_per_batch N or
          --cap-per-batch), each request naming its adapter (lora_path per prompt)
  merged  adapter k merged into the base (peft merge_and_unload, cached under models/lora-merged/),
          one Engine per merged checkpoint, serving only the requests that use adapter k, the
          engines one after the other: its wall time is the sum over the N engines, start-up
          left out. One merged engine serves its share for every N (start-up is not timed).
tok/s counts output tokens over wall time; the printed ratios are lora / base and lora / merged.
--repeat R runs each measurement R times and keeps the fastest (all walls are in the JSON).
NOTE: W3 cut to 8 conversations uses only 8 of the 16 adapters at N=16 (conversation i uses i % N).
NOTE: the engines are compute bound on 2 cores: another job on the machine (a test run) slows a
measurement several times over (seen: 41 s vs 131 s for the same W2 on the same weights). Run it
on a quiet machine and check `uptime` before reading ratios.

    .venv/bin/python bench/lora.py                                   # repeat 2, all 16 merged engines
    .venv/bin/python bench/lora.py --repeat 1 --merged-sample16 4    # ~23 min on 2 cores

Writes bench/results/lora.json and bench/results/lora.png.
"""

from __future__ import annotations

import argparse
import gc
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import RESULTS, ROOT, write_result
from peaks import host

sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, "/work/shared/peers")
import workloads as W
from support.lora_adapters import ensure_adapter

SMALL = Path.home() / ".cache/radixrt-peers/models/small"
MERGED_ROOT = ROOT / "models" / "lora-merged"
TARGETS = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SEED0 = 3700
WORKLOADS = ("W2_unique", "W3_multiturn")
ENGINE_ARGS = {"dtype": "bfloat16", "page_size": 16, "max_running_requests": 64}

Generate = Callable[[list[list[int]], int], list[list[int]]]


def cut_workloads(model: Path, w2_prompts: int, w3_convs: int) -> dict[str, dict]:
    """W2 and W3 of workloads.py, cut to the first w2_prompts prompts and w3_convs conversations."""
    wls = W.make_workloads(str(model))
    w2, w3 = dict(wls["W2_unique"]), dict(wls["W3_multiturn"])
    w2["prompts"] = w2["prompts"][:w2_prompts]
    w3["user_msgs"], w3["n_conv"] = w3["user_msgs"][:w3_convs], w3_convs
    return {"W2_unique": w2, "W3_multiturn": w3}


def share(wl: dict, k: int, n: int) -> dict:
    """The requests of wl that use adapter k of n (request / conversation i uses i % n)."""
    out = dict(wl)
    if wl["kind"] == "static":
        out["prompts"] = wl["prompts"][k::n]
    else:
        out["user_msgs"] = wl["user_msgs"][k::n]
        out["n_conv"] = len(out["user_msgs"])
    return out


def adapters(rank: int, count: int) -> list[Path]:
    """count deterministic PEFT adapters for SMALL (built once, cached under models/lora/small/)."""
    return [ensure_adapter(SMALL, f"bench{k}", seed=SEED0 + k, r=rank, alpha=2 * rank, target_modules=TARGETS)
            for k in range(count)]  # fmt: skip


def merged_checkpoint(adapter: Path) -> Path:
    """adapter merged into SMALL's weights (float32 merge, saved bfloat16), with the tokenizer files."""
    out = MERGED_ROOT / SMALL.name / adapter.name
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(SMALL, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, adapter).merge_and_unload().to(torch.bfloat16)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    for name in TOKENIZER_FILES:
        if (SMALL / name).is_file():
            shutil.copy(SMALL / name, tmp / name)
    tmp.rename(out)  # complete or absent: a killed run leaves only the .tmp
    return out


def make_generate(eng: Any, names: Callable[[int], list[str]] | None) -> Generate:
    """workloads.py's driver over eng; names(len(prompts)) gives each prompt's adapter (None: no LoRA)."""

    def generate(prompts: list[list[int]], n: int) -> list[list[int]]:
        sp = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
        extra = {"lora_path": names(len(prompts))} if names else {}
        outs = eng.generate(input_ids=prompts, sampling_params=sp, **extra)
        res = [list(o["output_ids"]) for o in outs]
        assert all(len(r) == n for r in res), [len(r) for r in res][:8]
        return res

    return generate


def measure(eng: Any, wl: dict, generate: Generate, repeat: int) -> dict:
    """The fastest of repeat runs of wl (cache flushed before each), with every wall and the outputs."""
    reps = []
    for _ in range(repeat):
        eng.flush_cache()
        reps.append(W.run_workload(wl, generate))
    best = min(reps, key=lambda r: r["wall_s"])
    return {"wall_s": best["wall_s"], "wall_all_s": [r["wall_s"] for r in reps], "n_req": best["n_req"],
                "prompt_tokens": best["prompt_tokens"], "output_tokens": best["output_tokens"],
                "output_tok_s": best["output_tok_s"], "turn_times": best["turn_times"], "outputs": best["outputs"]}  # fmt: skip


def start(**kw: Any) -> tuple[Any, float]:
    """An Engine on kw plus ENGINE_ARGS, warmed up (untimed), and its start-up seconds."""
    import radixrt

    t0 = time.perf_counter()
    eng = radixrt.Engine(**ENGINE_ARGS, **kw)
    load_s = time.perf_counter() - t0
    warm = make_generate(eng, (lambda n: ["a0"] * n) if kw.get("lora_paths") else None)
    warm([list(range(10, 300)), list(range(20, 60))], 4)
    return eng, load_s


def run_engine(kw: dict, wls: dict, names: Callable[[int], list[str]] | None, repeat: int) -> dict:
    """Every workload through one fresh Engine; results by workload, plus its start-up and stats."""
    eng, load_s = start(**kw)
    try:
        gen = make_generate(eng, names)
        out = {}
        for name, wl in wls.items():
            out[name] = measure(eng, wl, gen, repeat)
            print(f"  {name}: {out[name]['output_tok_s']:.1f} output tok/s, wall {out[name]['wall_s']:.1f}s", flush=True)
        info = eng.get_server_info()
        out["_engine"] = {"load_s": load_s, "stats": {k: v for k, v in info.items() if k.startswith("lora")}}
    finally:
        eng.shutdown()
        gc.collect()
    return out


def run_merged(adapters_: list[Path], counts: list[int], wls: dict, repeat: int, sample16: int) -> dict:
    """For each adapter k, one engine on its merged checkpoint serving its share for every N > k.
    -> {N: {workload: {wall_s, output_tokens, shares, ...}}}; sample16 < 16 measures only that many
    of N=16's engines and scales their sum by 16 / sample16 (flagged "scaled_from")."""
    res: dict[int, dict[str, dict]] = {n: {w: {"wall_s": 0.0, "output_tokens": 0, "shares": []} for w in wls} for n in counts}
    for k, adapter in enumerate(adapters_):
        wanted = [n for n in counts if k < n and not (n == 16 and k >= sample16)]
        if not wanted:
            continue
        path = merged_checkpoint(adapter)
        eng, load_s = start(model_path=str(path))
        try:
            gen = make_generate(eng, None)
            for n in wanted:
                for name, wl in wls.items():
                    r = measure(eng, share(wl, k, n), gen, repeat)
                    agg = res[n][name]
                    agg["wall_s"] += r["wall_s"]
                    agg["output_tokens"] += r["output_tokens"]
                    agg["shares"].append(dict(adapter=k, load_s=load_s, **{x: r[x] for x in ("wall_s", "wall_all_s", "n_req", "output_tokens")}))
                    agg.setdefault("outputs", {})[k] = r["outputs"]
            walls = {n: {w: round(res[n][w]["shares"][-1]["wall_s"], 1) for w in wls} for n in wanted}
            print(f"  merged adapter {k}: start {load_s:.1f}s, share walls {walls}", flush=True)
        finally:
            eng.shutdown()
            gc.collect()
    for n in counts:
        for agg in res[n].values():
            if n == 16 and sample16 < 16:
                agg["scaled_from"] = sample16
                agg["wall_s"] *= 16 / sample16
                agg["output_tokens"] = round(agg["output_tokens"] * 16 / sample16)
            agg["output_tok_s"] = agg["output_tokens"] / agg["wall_s"]
    return res


def same_outputs(lora_outs: list[list[int]], merged_outs: dict[int, list[list[int]]], n: int) -> float:
    """Share of W2 requests whose greedy output under LoRA equals the merged engine's (bf16 may differ)."""
    pairs = [(lora_outs[k::n][i], outs[i]) for k, outs in merged_outs.items() for i in range(len(outs))]
    return sum(a == b for a, b in pairs) / max(1, len(pairs))


def table(base: dict, lora: dict, merged: dict, counts: list[int]) -> list[dict]:
    """Rows of tok/s and ratios per workload and adapter count."""
    rows = []
    for name in WORKLOADS:
        for n in counts:
            lt, bt, mt = lora[n][name]["output_tok_s"], base[name]["output_tok_s"], merged[n][name]["output_tok_s"]
            row = {"workload": name, "adapters": n, "base_tok_s": bt, "lora_tok_s": lt, "merged_tok_s": mt,
                       "lora_over_base": lt / bt, "lora_over_merged": lt / mt,
                       "merged_scaled_from": merged[n][name].get("scaled_from")}  # fmt: skip
            if name == "W2_unique":
                row["w2_same_outputs_as_merged"] = same_outputs(lora[n][name]["outputs"], merged[n][name]["outputs"], n)
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"\n{'workload':14} {'N':>3} {'base tok/s':>10} {'lora tok/s':>10} {'merged tok/s':>12} "
          f"{'lora/base':>9} {'lora/merged':>11}")  # fmt: skip
    for r in rows:
        scaled = f" (merged scaled from {r['merged_scaled_from']})" if r["merged_scaled_from"] else ""
        print(f"{r['workload']:14} {r['adapters']:>3} {r['base_tok_s']:>10.1f} {r['lora_tok_s']:>10.1f} "
              f"{r['merged_tok_s']:>12.1f} {r['lora_over_base']:>9.2f} {r['lora_over_merged']:>11.2f}{scaled}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(WORKLOADS), figsize=(11, 4.2))
    for ax, name in zip(axes, WORKLOADS):
        sub = [r for r in rows if r["workload"] == name]
        xs = range(len(sub))
        for j, (key, label) in enumerate((("base_tok_s", "base alone"), ("lora_tok_s", "multi-LoRA (one engine)"),
                                          ("merged_tok_s", "merged, one engine per adapter"))):  # fmt: skip
            bars = ax.bar([x + (j - 1) * 0.27 for x in xs], [r[key] for r in sub], 0.27, label=label)
            if key == "lora_tok_s":
                for b, r in zip(bars, sub):
                    ax.annotate(f"{r['lora_over_base']:.2f}x base\n{r['lora_over_merged']:.2f}x merged",
                                (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(list(xs), [f"{r['adapters']} adapter{'s' if r['adapters'] > 1 else ''}" for r in sub])
        ax.set_title(name)
        ax.set_ylabel("output tok/s")
        ax.margins(y=0.2)
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle("radixrt multi-LoRA on small (88M, bf16, CPU): uniform adapter mix")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="1,4,16", help="adapter counts N, comma-separated")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--w2-prompts", type=int, default=32, help="W2_unique cut to its first prompts (of 64)")
    ap.add_argument("--w3-convs", type=int, default=8, help="W3_multiturn cut to its first conversations (of 16)")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement; the fastest is kept")
    ap.add_argument("--cap-per-batch", type=int, default=16, help="max_loras_per_batch is min(N, this)")
    ap.add_argument("--merged-sample16", type=int, default=16, help="merged engines measured for N=16 (scaled)")
    args = ap.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    cpu = host()
    print(cpu, flush=True)
    t_all = time.perf_counter()
    wls = cut_workloads(SMALL, args.w2_prompts, args.w3_convs)
    paths = adapters(args.rank, max(counts))
    print("base ...", flush=True)
    base = run_engine({"model_path": str(SMALL)}, wls, None, args.repeat)
    lora, engines = {}, {}
    for n in counts:
        per_batch = min(n, args.cap_per_batch)
        print(f"lora N={n} (max_loras_per_batch {per_batch}) ...", flush=True)
        kw = {"model_path": str(SMALL), "lora_paths": [f"a{k}={p}" for k, p in enumerate(paths[:n])],
                  "max_loras_per_batch": per_batch, "max_loaded_loras": n}  # fmt: skip
        lora[n] = run_engine(kw, wls, lambda m, n=n: [f"a{i % n}" for i in range(m)], args.repeat)
        engines[n] = dict(max_loras_per_batch=per_batch, max_loaded_loras=n, **lora[n].pop("_engine"))
    print("merged ...", flush=True)
    merged = run_merged(paths, counts, wls, args.repeat, args.merged_sample16)
    rows = table(base, lora, merged, counts)
    print_table(rows)

    def strip(d: dict) -> dict:
        return {k: v for k, v in d.items() if k != "outputs"}

    result = {
        "model": str(SMALL), "host": cpu, "engine_args": ENGINE_ARGS, "rank": args.rank, "targets": TARGETS, "repeat": args.repeat,
        "workloads": {"W2_unique": f"first {args.w2_prompts} of 64 prompts", "W3_multiturn": f"first {args.w3_convs} of 16 conversations x 4 turns"},
        "adapter_seeds": [SEED0 + k for k in range(max(counts))], "rows": rows,
        "base": {k: strip(v) for k, v in base.items() if k != "_engine"}, "base_engine": base["_engine"],
        "lora": {n: {w: strip(r) for w, r in lora[n].items()} for n in counts}, "lora_engines": engines,
        "merged": {n: {w: strip(r) for w, r in merged[n].items()} for n in counts},
        "merged_note": "sum over one engine per adapter of its share's wall time, start-up excluded",
        "total_run_s": time.perf_counter() - t_all,
    }  # fmt: skip
    print("\nwrote", write_result("lora", result))
    plot(rows, RESULTS / "lora.png")
    print("wrote", RESULTS / "lora.png")


if __name__ == "__main__":
    main()

"""Structured generation: a JSON-schema extraction workload, unconstrained beside masked, same run.

64 requests, each asking for one object with 6 fields (name, age, city, email, active, score),
greedy, on each model. Prints output tok/s, forward steps and how many outputs validate, for
  unconstrained: the same prompts and max_new_tokens, no grammar (random weights never write JSON);
  masked:        sampling_params.json_schema (compact JSON), xgrammar's mask before sampling,
                 every token sampled (--disable-jump-forward);
  jump_forward:  masked, and where the grammar allows one continuation its tokens are appended
                 and run in the next step (the default);
and the schema's compile time, cold and cached. Writes bench/results/structured.json and .png.

    .venv/bin/python bench/structured.py [--models tiny,DIR] [--num-requests 64]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from common import ensure_model, save_model_result

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Lima", "Oslo", "Cairo", "Quito"]},
        "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
        "active": {"type": "boolean"},
        "score": {"type": "number", "minimum": 0, "maximum": 100},
    },
    "required": ["name", "age", "city", "email", "active", "score"],
    "additionalProperties": False,
}
MAX_NEW = 96


def _valid(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text, strict=False), SCHEMA)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def run_mode(engine: Any, prompts: list[str], constrained: bool) -> dict[str, float]:
    sp: dict[str, Any] = {"max_new_tokens": MAX_NEW, "temperature": 0}
    if constrained:
        sp["json_schema"] = json.dumps(SCHEMA)
    steps = engine.get_server_info()["forward_steps"]
    t = time.perf_counter()
    out = engine.generate(prompts, sp)
    elapsed = time.perf_counter() - t
    tokens = sum(o["meta_info"]["completion_tokens"] for o in out)
    return {
        "seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
        "forward_steps": engine.get_server_info()["forward_steps"] - steps,
        "valid": sum(_valid(o["text"]) for o in out), "stopped": sum(o["meta_info"]["finish_reason"]["type"] == "stop" for o in out),
    }


def compile_times(path: Path) -> dict[str, float]:
    from transformers import AutoConfig, AutoTokenizer

    from radixrt.constrained.grammar import GrammarCompiler

    tok = AutoTokenizer.from_pretrained(path)
    compiler = GrammarCompiler(tok, AutoConfig.from_pretrained(path).vocab_size, [tok.eos_token_id], any_whitespace=False)
    times = []
    for _ in range(2):
        t = time.perf_counter()
        compiler.compile("json_schema", json.dumps(SCHEMA))
        times.append(time.perf_counter() - t)
    return {"compile_cold_ms": times[0] * 1e3, "compile_cached_ms": times[1] * 1e3}


def bench(path: Path, n: int) -> dict[str, Any]:
    import radixrt

    prompts = [f"Extract the record of person {i} as JSON: {i * 7 % 13} apples, {i % 5} trips." for i in range(n)]
    args = dict(model_path=str(path), page_size=16, max_total_tokens=n * 160 + 2048, constrained_json_disable_any_whitespace=True)
    modes = {}
    for jumps in (False, True):
        with radixrt.Engine(disable_jump_forward=not jumps, **args) as e:
            e.generate(prompts[:2], {"max_new_tokens": 4, "json_schema": json.dumps(SCHEMA)})  # warm up, grammar cached
            if jumps:
                modes["jump_forward"] = run_mode(e, prompts, True)
            else:
                modes["unconstrained"], modes["masked"] = run_mode(e, prompts, False), run_mode(e, prompts, True)
    res = {"modes": modes, **compile_times(path)}
    base = modes["unconstrained"]["output_tok_s"]
    for name, m in modes.items():
        print(f"  {name:14} {m['output_tok_s']:8.1f} tok/s ({m['output_tok_s'] / base:5.2f}x)  steps {m['forward_steps']:4d}"
              f"  valid {m['valid']}/{n}  stop {m['stopped']}/{n}")
    print(f"  compile: cold {res['compile_cold_ms']:.2f} ms, cached {res['compile_cached_ms']:.3f} ms")
    return res


def plot(models: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    names = list(models)
    modes = ["unconstrained", "masked", "jump_forward"]
    for k, mode in enumerate(modes):
        ax.bar([i + 0.27 * k for i in range(len(names))], [models[m]["modes"][mode]["output_tok_s"] for m in names],
               width=0.27, label=mode)
    ax.set_xticks([i + 0.27 for i in range(len(names))], names)
    ax.set_ylabel("output tok/s")
    ax.set_title("JSON-schema extraction, 64 requests")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny")
    parser.add_argument("--num-requests", type=int, default=64)
    args = parser.parse_args()
    for name in args.models.split(","):
        path = Path(name) if Path(name).is_dir() else ensure_model("llama", name)
        print(f"{name}:")
        save_model_result("structured", name, bench(path, args.num_requests), plot)


if __name__ == "__main__":
    main()

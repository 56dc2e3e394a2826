"""Constrained JSON under a whitespace bound: how often random weights end in valid JSON.

A weak model under a json_schema whose grammar allows any whitespace between JSON tokens can
spend its whole budget on newlines. For each bound of --constrained-json-max-whitespace
(0 compact, n at most n characters in a row, -1 any) and each schema (a record of enums and
maxLength strings, a tool_choice "required" call array, response_format json_object), 30 seeded
runs (temperature 1, seeds 0..29, 200 new tokens, one batched call) of the random-weight tiny
models: the share that end in valid JSON, the longest whitespace run between JSON tokens, mean
output tokens. Writes bench/results/json_whitespace.json.

    .venv/bin/python bench/json_whitespace.py [--models llama,qwen2] [--bounds 0,1,2,3,4,8,-1]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from common import ensure_model, write_result

RUNS, MAX_NEW = 30, 200
PROMPT = "Reply with the record as JSON."
RECORD = {  # enums and maxLength strings, one nested object (indented two levels when pretty-printed)
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "city": {"enum": ["Paris", "Lima", "Oslo", "Cairo"]},
        "mood": {"enum": ["calm", "busy", "tired"]},
        "address": {
            "type": "object",
            "properties": {"zip": {"type": "string", "maxLength": 5}, "country": {"enum": ["FR", "PE", "NO", "EG"]}},
            "required": ["zip", "country"], "additionalProperties": False,
        },
        "note": {"type": "string", "maxLength": 20},
    },
    "required": ["name", "city", "mood", "address", "note"],
    "additionalProperties": False,
}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}


def schemas() -> dict[str, str]:
    from radixrt.server.openai_api import JSON_OBJECT_SCHEMA
    from radixrt.server.tool_calls import tool_choice_schema

    return {"record": json.dumps(RECORD), "tool_required": tool_choice_schema([WEATHER_TOOL], "required"),
            "json_object": JSON_OBJECT_SCHEMA}


def longest_whitespace_run(text: str) -> int:
    """The longest run of whitespace outside JSON strings (between JSON tokens)."""
    longest = run = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            in_string = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
            continue
        run = run + 1 if ch in " \n\t\r" else 0
        longest = max(longest, run)
        in_string = ch == '"'
    return longest


def is_json(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def measure(engine: Any, schema: str) -> dict[str, Any]:
    params = [{"temperature": 1.0, "seed": seed, "max_new_tokens": MAX_NEW, "json_schema": schema} for seed in range(RUNS)]
    outs = engine.generate([PROMPT] * RUNS, params)
    return {
        "valid": sum(is_json(o["text"]) for o in outs) / RUNS,
        "longest_ws_run": max(longest_whitespace_run(o["text"]) for o in outs),
        "mean_tokens": sum(o["meta_info"]["completion_tokens"] for o in outs) / RUNS,
        "with_newline": sum("\n" in o["text"] for o in outs) / RUNS,
    }


def bench(family: str, bounds: list[int]) -> dict[str, Any]:
    import radixrt

    path = ensure_model(family)
    rows: dict[str, Any] = {}
    for bound in bounds:
        with radixrt.Engine(model_path=str(path), page_size=16, max_total_tokens=RUNS * 256 + 1024,
                            constrained_json_max_whitespace=bound) as engine:
            rows[str(bound)] = {name: measure(engine, text) for name, text in schemas().items()}
        for name, m in rows[str(bound)].items():
            print(f"{family:6} {bound:>3} {name:14} valid {m['valid']:5.0%}  longest ws {m['longest_ws_run']:4d}  "
                  f"tokens {m['mean_tokens']:6.1f}  with \\n {m['with_newline']:4.0%}", flush=True)
    return rows


def summary(results: dict[str, Any], baseline: str = "-1") -> dict[str, Any]:
    """Per bound, over every model and schema: the mean share that ends valid and the mean tokens,
    each as a ratio to the unbounded run's (the baseline, measured in the same run)."""
    bounds = next(iter(results.values())).keys()
    cells = {b: [m for rows in results.values() for m in rows[b].values()] for b in bounds}
    mean = {b: (sum(m["valid"] for m in c) / len(c), sum(m["mean_tokens"] for m in c) / len(c)) for b, c in cells.items()}
    base_valid, base_tokens = mean[baseline]
    return {b: {"valid": v, "tokens": t, "valid_vs_any": v / base_valid if base_valid else None,
                "tokens_vs_any": t / base_tokens} for b, (v, t) in mean.items()}


def print_summary(table: dict[str, Any]) -> None:
    print(f"{'ws':>3} {'valid':>6} {'x any':>6} {'tokens':>7} {'x any':>6}")
    for b, row in table.items():
        ratio = "-" if row["valid_vs_any"] is None else f"{row['valid_vs_any']:.2f}x"
        print(f"{b:>3} {row['valid']:6.0%} {ratio:>6} {row['tokens']:7.1f} {row['tokens_vs_any']:5.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,qwen2")
    parser.add_argument("--bounds", default="0,1,2,3,4,8,-1", help="0 compact, -1 any")
    args = parser.parse_args()
    bounds = [int(b) for b in args.bounds.split(",")]
    print(f"{'model':6} {'ws':>3} {'schema':14} (of {RUNS} seeded runs, {MAX_NEW} new tokens, temperature 1)")
    if -1 not in bounds:
        bounds.append(-1)  # the baseline every bound is compared with
    results = {family: bench(family, bounds) for family in args.models.split(",")}
    table = summary(results)
    print_summary(table)
    print("wrote", write_result("json_whitespace", {"runs": RUNS, "max_new_tokens": MAX_NEW, "models": results,
                                                    "vs_any_whitespace": table}))


if __name__ == "__main__":
    main()

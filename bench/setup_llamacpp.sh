#!/usr/bin/env bash
# llama.cpp as a GGUF peer: llama-cpp-python (PyPI, its sdist builds llama.cpp from source, ~5 minutes on 2
# cores) in its own venv, $PEERS/peer-llamacpp (default $HOME/.cache/radixrt-peers), with numpy, tokenizers
# and gguf for bench/gguf_peer.py and scripts/make_gguf_variants.py. Idempotent.
#
# Built for AVX2/AVX-512 (VNNI, BF16) with its CPU repack kernels, not for AMX: llama.cpp's AMX backend
# segfaults in its first decode on the AMX Xeon we measure on, for every quantized type (llama.cpp issue
# #20824, open: "segfault in ggml_backend_amx_mul_mat", machine-dependent; dspy dropped its AMX build for
# it). LLAMA_NATIVE=1 builds with -march=native instead (AMX included where the CPU has it).
set -euo pipefail
PEERS=${PEERS:-$HOME/.cache/radixrt-peers}
VENV=${LLAMA_VENV:-$PEERS/peer-llamacpp}
[ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import llama_cpp, tokenizers, gguf" 2>/dev/null && { echo "$VENV"; exit 0; }
python3.11 -m venv "$VENV"
if [ "${LLAMA_NATIVE:-0}" = 1 ]; then
  args="-DGGML_NATIVE=ON"
else
  args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
  if grep -q avx512f /proc/cpuinfo; then
    args="$args -DGGML_AVX512=ON"
    for f in vbmi vnni bf16; do grep -q "avx512_$f\|avx512$f" /proc/cpuinfo && args="$args -DGGML_AVX512_${f^^}=ON"; done
  fi
  grep -q avx_vnni /proc/cpuinfo && args="$args -DGGML_AVX_VNNI=ON"
  args="$args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
fi
CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) CMAKE_ARGS="$args" "$VENV/bin/pip" install -q llama-cpp-python==0.3.36 numpy tokenizers gguf
echo "$VENV"

#!/usr/bin/env bash
# The GPU check, run on the GPU machine (one H200, Python 3.12, torch 2.11+cu130, nvcc 13.0, no
# network). Prepare here first: ./scripts/gpu_wheels.sh (fills .whl/, git-ignored), then run this
# through the device tool with carry [".whl"]. It installs the carried wheels, runs the CUDA tests
# (FlashInfer against the torch reference on the same pool; the engine on CUDA against
# transformers; decode CUDA graphs against eager decode) and the GPU benchmark (bench/gpu_decode.py:
# decode tok/s from CUDA graphs, batch 1 also eager; bench/flashinfer_extend.py: the two ways to
# attend an extend), and copies the results to $OUT.
# Budget: FlashInfer JIT-compiles its kernels on first use (minutes); tests and benchmark together
# stop at BUDGET seconds (under 8 minutes), the benchmark getting whatever the tests leave.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site FLASHINFER_CUDA_ARCH_LIST=9.0a MAX_JOBS=16
# -P: never put the repo root on sys.path; its radixrt/ lacks the kernels/ and lang/ mapping the wheel installs.
py="python3 -P"
nvidia-smi -L
$py -c "import torch, flashinfer, radixrt.kernels; print('torch', torch.__version__, 'flashinfer', flashinfer.__version__, torch.cuda.get_device_name())" || exit 1
BUDGET=450
start=$(date +%s)
timeout $(( BUDGET - 120 )) $py -m pytest -q -rs -p no:cacheprovider tests/test_torch_backend.py tests/test_attention_options.py tests/test_cuda.py
tests_rc=$?
echo "tests: rc=$tests_rc in $(( $(date +%s) - start )) s"
# ragged + paged + merge against one paged causal pass for extends (which FlashInferBackend uses)
timeout 60 $py bench/flashinfer_extend.py
extend_rc=$?
left=$(( BUDGET - ($(date +%s) - start) ))
timeout $(( left > 60 ? left : 60 )) $py bench/gpu_decode.py
bench_rc=$?
[ "$extend_rc" -eq 0 ] || bench_rc=$extend_rc
mkdir -p "${OUT:-/tmp/out}" && cp bench/results/gpu_decode.json bench/results/flashinfer_extend.json "${OUT:-/tmp/out}/" 2>/dev/null
echo "total $(( $(date +%s) - start )) s; tests rc=$tests_rc, bench rc=$bench_rc"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]

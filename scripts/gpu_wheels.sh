#!/usr/bin/env bash
# Build the wheels that scripts/gpu_check.sh needs on the GPU machine (Python 3.12, no network),
# into .whl/ (git-ignored; carry it with the device call). The machine's image already has
# torch, transformers, safetensors, tokenizers, pytest, uvloop, sortedcontainers and
# prometheus-client; these are what it lacks. flashinfer-python 0.6.13 is the newest that fits
# the 64 MiB carry (it JIT-compiles its kernels with the machine's nvcc).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${platforms[@]}" -d .whl flashinfer-python==0.6.13 apache-tvm-ffi==0.1.15.post2 msgspec pyzmq fastapi uvicorn \
  starlette pydantic pydantic-core annotated-types typing-inspection
.venv/bin/python -m pip wheel -q --no-deps -w .whl .   # radixrt itself, with its compiled-kernel sources
du -sh .whl && ls .whl

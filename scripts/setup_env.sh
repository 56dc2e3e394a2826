#!/usr/bin/env bash
# Make .venv when missing and install the project with the runtime ([srt]) and dev extras.
# Machines without a GPU get the CPU build torch==2.13.0; machines with one, a CUDA build.
# Re-running is cheap: it skips pip when nothing it installs from has changed.
set -euo pipefail
cd "$(dirname "$0")/.."

# tcmalloc for the CPU workers (radixrt/launch/worker_env.py), from Debian where we may install
# it; without it the workers keep glibc's allocator, tuned, and say so in their log.
if ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -q && apt-get install -y -q libtcmalloc-minimal4; } >/dev/null 2>&1 \
    || echo "setup_env: could not install libtcmalloc-minimal4; CPU workers use glibc's allocator"
fi
# libibverbs1 for the Mooncake Store client ([mooncake]: --hicache-storage-backend mooncake); without
# it that backend says so at start and its tests fail, naming the package.
if ! ls /usr/lib/*/libibverbs.so.1 >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  { apt-get update -q && apt-get install -y -q libibverbs1; } >/dev/null 2>&1 \
    || echo "setup_env: could not install libibverbs1; the Mooncake Store backend cannot start"
fi
if [ ! -x .venv/bin/python ]; then
  "${PYTHON:-python3}" -m venv .venv
fi
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  torch_req="torch"
else
  torch_req="torch==2.13.0"
fi
stamp=.venv/.radixrt-installed
want="$(cat pyproject.toml scripts/setup_env.sh | sha256sum | cut -d' ' -f1) $torch_req"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  .venv/bin/python -m pip install -q --disable-pip-version-check "$torch_req"
  .venv/bin/python -m pip install -q --disable-pip-version-check -e ".[srt,dev,router,mooncake]"
  # SGLang's frontend, for the compatibility tests only: without its runtime dependencies
  # (those would pull a second torch and CUDA); its frontend's own imports come with [dev].
  .venv/bin/python -m pip install -q --disable-pip-version-check --no-deps "sglang==0.5.9"
  echo "$want" > "$stamp"
fi

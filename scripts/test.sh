#!/usr/bin/env bash
# Set up (see setup_env.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
# The pytest entry point, not `python -m pytest`: that would put the repo root on
# sys.path, where the kernels/ folder could shadow a PyPI package of that name.
exec .venv/bin/pytest -q "$@"

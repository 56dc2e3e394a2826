#!/usr/bin/env bash
# Set up (see setup_env.sh) and run the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
exec .venv/bin/pytest -q "$@"

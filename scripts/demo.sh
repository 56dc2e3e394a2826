#!/usr/bin/env bash
# Set up, serve the demo model committed in assets/world-llama (no download), and run
# the demo's DSL programs against it; everything stops at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
exec .venv/bin/python scripts/demo.py "$@"

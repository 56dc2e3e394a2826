#!/usr/bin/env bash
# Set up, build the built-in tiny demo model (deterministic, no download), and run
# the demo program through radixrt's engine processes; everything stops at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
exec .venv/bin/python scripts/demo.py "$@"

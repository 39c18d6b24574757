#!/usr/bin/env bash
# The README's test command: set up everything, then run the whole suite against real parts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -ra --durations=25 "$@"

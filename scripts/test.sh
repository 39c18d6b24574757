#!/usr/bin/env bash
# The README's test command: set up everything, then run the whole suite against real parts.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers: the heavy tests (Docker, Ray, the browser, training) one after another in one of them, the fast tier
# beside them in the other (tests/conftest.py; docs/how-to/run-the-tests.md).
exec "${PYTHON:-python3}" -m pytest -n 2 --dist loadgroup -ra --durations=25 "$@"

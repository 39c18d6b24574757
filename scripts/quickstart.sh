#!/usr/bin/env bash
# The README's main job: set up a fresh machine, then run the quickstart GRPO training end to end
# (tiny local model, three Docker-sandboxed rewards). Extra arguments override config fields,
# e.g. `bash scripts/quickstart.sh --grpo.max_steps 5`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec rewardbox train examples/quickstart/config.yaml "$@"

#!/usr/bin/env bash
# Everything a fresh Debian/Ubuntu machine needs for rewardbox: the Docker engine (started if not running),
# debootstrap for the offline base image, Chromium for the report's browser tests, and the Python package with its
# train, dev, ray and openrlhf extras, verl in .venv-verl for the verl integration's test, and OpenRLHF's files in
# .openrlhf for the OpenRLHF integration's.
# Idempotent: each step is skipped when already done. Fails loudly when a step cannot be done.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

need_apt=()
command -v dockerd >/dev/null 2>&1 || need_apt+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || need_apt+=(debootstrap)
command -v runsc >/dev/null 2>&1 || need_apt+=(runsc)  # gVisor, for `sandbox.runtime: runsc`
# The browser the report's tests drive (playwright with executable_path: its own download cannot work offline)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)
# apparmor_parser compiles `rewardbox apparmor`'s profile in the tests (it is in /sbin, outside a user's PATH)
[ -x /sbin/apparmor_parser ] || [ -x /usr/sbin/apparmor_parser ] || need_apt+=(apparmor)
if [ ${#need_apt[@]} -gt 0 ]; then
  log "installing ${need_apt[*]} from Debian packages"
  as_root apt-get update -qq
  DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq "${need_apt[@]}" >/dev/null
fi

if ! docker info >/dev/null 2>&1; then
  # Started here, the engine also gets the gVisor runtime (scripts/dockerd.json). An engine that is already
  # running is left as it is: register runsc in its daemon.json to use `sandbox.runtime: runsc` there.
  log "starting the Docker engine (with the runsc runtime)"
  as_root sh -c "nohup dockerd --config-file '$PWD/scripts/dockerd.json' >/var/log/rewardbox-dockerd.log 2>&1 &"
  for _ in $(seq 1 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
  if ! docker info >/dev/null 2>&1; then
    echo "setup: the Docker engine did not start; see /var/log/rewardbox-dockerd.log" >&2
    exit 1
  fi
fi

PY=${PYTHON:-python3}
# torch==2.13.0 is the CPU build here; installing it first keeps the train extra from pulling CUDA wheels.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  log "installing torch==2.13.0"
  "$PY" -m pip install -q torch==2.13.0
fi
log "installing rewardbox[train,dev,ray,openrlhf]"
"$PY" -m pip install -q -e ".[train,dev,ray,openrlhf]"
# verl, for the verl integration's test: in a venv of its own over this environment (its pins would replace this
# environment's transformers), without its GPU stack; only what importing verl's reward path needs is added.
if ! .venv-verl/bin/python -c "import verl.trainer.ppo.reward" >/dev/null 2>&1; then
  log "installing verl into .venv-verl (over this environment, no GPU stack)"
  "$PY" -m venv --system-site-packages .venv-verl
  .venv-verl/bin/python -m pip install -q --no-deps verl==0.9.1 tensordict==0.15.3 hydra-core==1.3.8 \
    omegaconf==2.4.0 antlr4-python3-runtime==4.9.3 codetiming pylatexenc pyvers orjson importlib_metadata
  .venv-verl/bin/python -m pip install -q aiohttp
fi
# OpenRLHF's own files (its reward client, openrlhf/utils/agent.py, which the OpenRLHF tests load as OpenRLHF's own
# tests do), without its GPU stack or any of its pins: in a folder of their own, on no sys.path.
if [ ! -f .openrlhf/openrlhf/utils/agent.py ]; then
  log "installing OpenRLHF's files into .openrlhf (no dependencies)"
  "$PY" -m pip install -q --no-deps --target .openrlhf openrlhf==0.11.2
fi
# The offline base image (Debian + python3 from Debian packages): no container registry is needed.
log "base image: $(rewardbox base-image)"
log "done"

"""Numbers both sides must agree on. Standard library only (see the package docstring)."""

from __future__ import annotations

# The gRPC service's full name (package ``rewardbox.v1`` in reward.proto), for health checks and reflection.
SERVICE_NAME = "rewardbox.v1.RewardSandbox"

# gRPC's default is 4 MiB; a batch of long completions (or their captured output) can exceed it.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = (
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
)

# Slack on top of a reward's timeout before the sandbox kills a worker from outside (IPC, result transfer). The
# host's per-attempt deadline is built on it, so the server always answers before the client gives up.
HARD_TIMEOUT_MARGIN_S = 2.0

# The Style enum of reward.proto (STYLE_<NAME>) by number (tool, environment: rewardbox.sandboxed_tools and
# rewardbox.sandboxed_environment).
STYLE_NAMES = {1: "sample", 2: "batch", 3: "tool", 4: "environment"}
# Styles whose calls answer a result (Score.result_json), not a score.
CALL_STYLES = ("tool", "environment")

# Per-reward defaults: the config's defaults, and what the server uses when a Load request leaves a field at 0.
DEFAULT_WORKERS = 2
# Async functions are mostly I/O-bound (a judge over HTTP): each worker keeps as many calls in flight as TRL's own
# asyncio.gather would for a 128-completion batch.
DEFAULT_CONCURRENCY = 128
DEFAULT_MAX_LOG_BYTES = 64 * 1024
DEFAULT_WARM = 32
# Under gVisor each process costs more (about 12 MiB and 10 host threads on its ptrace platform, measured).
GVISOR_WARM = 8

# Slot processes run under uids of their own, from this base up (no host user is expected there).
SLOT_UID_BASE = 100000


def sandbox_slots(isolation: str, workers: int, warm: int, style: str = "") -> int:
    """How many slots (uid + scratch directory) one version of a reward's function holds: ``warm`` pre-forked
    processes for ``isolation: sample`` and ``process`` (at least ``workers``), one per worker for ``isolation: worker``;
    for an environment (``workers``: its live episodes at most), one per live episode and as many prepared ahead, so
    that TRL's resets of a whole batch, one after another, each find a process ready (each reset's end of the last
    episode frees one, prepared again while the batch generates); for a tool (but under ``isolation: worker``), whose
    every call takes a process prepared for it alone, ``warm`` and one per worker. A sandbox has room for two versions at once,
    as a reload's new version starts while the old one finishes."""
    if style == "environment":
        return 2 * workers
    if style == "tool" and isolation != "worker":  # ``warm`` processes prepared for the next calls, and the running
        return max(workers, warm) + workers
    return workers if isolation == "worker" else max(workers, warm)

# The release, reported by every sandbox server (Describe) and the host package alike.
VERSION = "0.2.0"

# The keywords of TRL's reward call, shared by the host (start-up checks, the in-process path) and the sandbox.
# What TRL passes a batch-style function besides the dataset's columns:
BATCH_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state")
# The trainer's own objects TRL passes too; they cannot reach a sandbox, so a function may take them only with a
# default (which it gets there):
TRAINER_OBJECTS = ("log_extra", "log_metric", "environments")
# The optional keywords a sample-style function receives when it declares them:
OPTIONAL_KEYWORDS = ("trainer_state", "prompt_messages", "completion_messages", "completion_ids")

"""The ``docker`` backend: each replica of a reward is a hardened container (see :mod:`.containers` for what
each one gets). ``network: true`` gives egress (``sandbox.docker.network_mode``, bridge by default; no ports are
published); ``secrets`` passes exactly the named host environment variables to that reward's containers.
Containers carry labels naming the run and the owning process; those of a run whose process is gone are removed at
the next start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import socket
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence

import docker
import docker.errors
from pydantic import Field

from ..deploy import apparmor
from ..errors import BackendError, ConfigError
from ..images.image import IMAGE_REPO, ImageBuilder, image_key
from ..registry import BackendType
from ..spec import RewardSpec, SandboxSettings
from ..wire import DEFAULT_WARM, GVISOR_WARM, SLOT_UID_BASE, sandbox_slots
from .base import BackendSettings, reward_environment
from .containers import LABEL, ContainerSpec, DockerSandbox, is_gvisor, remove_leftovers

log = logging.getLogger("rewardbox")

NOBODY = 65534
# Processes of a sandbox itself (init, server, supervisor, templates) beside its slot processes.
OWN_PROCESSES = 16
# uids a container draws: its slot uids and their run uids (an environment of 1,024 live episodes: 2 versions x 2,048
# slots, and a run uid beside each). Blocks start below 2**30: a uid's top bit is the reaper's (tree.REAPER_UID_BIT).
UID_BLOCK = 16384
MIN_SLOT_PROCESSES = 16
# gVisor has no OOM killer of its own: the host's kills its kernel, that is the whole sandbox, when its processes
# together pass the memory limit (each costs about 12 MiB there, measured). So each sample process gets an address
# space limit, and a sample at most GVISOR_SAMPLE_PROCESSES processes, leaving this much for the sandbox itself.
GVISOR_OVERHEAD_BYTES = 256 << 20
GVISOR_MIN_SAMPLE_BYTES = 256 << 20
GVISOR_SAMPLE_PROCESSES = 16


def sample_limits(reward: RewardSpec, slots: int, gvisor: bool) -> tuple[int, Optional[int]]:
    """(RLIMIT_NPROC per slot uid, RLIMIT_AS per slot process or None) for a reward's samples."""
    if gvisor:
        memory = reward.memory_bytes
        return GVISOR_SAMPLE_PROCESSES, max(GVISOR_MIN_SAMPLE_BYTES,
                                            (memory - GVISOR_OVERHEAD_BYTES) // max(1, reward.workers))
    # Under runc the kernel's OOM killer takes the sample (oom_score_adj 1000); pids are the only shared budget. It
    # is shared by the samples running (workers) and by as many that just ended, whose leftovers are being killed.
    return max(MIN_SLOT_PROCESSES, (reward.pids - slots - OWN_PROCESSES) // (2 * max(1, reward.workers))), None


@dataclass(frozen=True)
class SlotPlan:
    """How one sandbox of a reward is divided: its slot uids and what each sample may use. The same for a
    container (:meth:`DockerBackend.create`) and a Kubernetes pod (:mod:`rewardbox.deploy.kubernetes`)."""

    slots: int  # slot uids (and scratch directories) of the sandbox
    default_warm: int  # warm processes of a reward that sets none
    sample_nproc: int  # RLIMIT_NPROC of each slot uid
    sample_memory: Optional[int]  # RLIMIT_AS of each slot process (gVisor), else None


def slot_plan(reward: RewardSpec, runtime: Optional[str]) -> SlotPlan:
    """The slots and per-sample limits of one sandbox of ``reward`` under container runtime ``runtime``.

    Raises:
        ConfigError: ``pids`` leaves too little room for the slots, naming the reward and the value to set.
    """
    gvisor = is_gvisor(runtime)
    default_warm = GVISOR_WARM if gvisor else DEFAULT_WARM
    per_version = sandbox_slots(reward.isolation, reward.workers, reward.warm or default_warm, reward.style)
    # Two versions of the function may run at once (a reload's new one while the old one finishes).
    slots = 2 * per_version
    if 2 * slots > UID_BLOCK:  # each slot uid has a run uid beside it, all in the container's block
        what = "max_episodes" if reward.style == "environment" else "workers"
        raise ConfigError(f"reward {reward.name!r}: {per_version} slot processes per version need "
                          f"{2 * slots} uids, over the {UID_BLOCK} a sandbox has: lower {what} (or warm), and use "
                          "replicas for more")
    needed = slots + 2 * reward.workers * MIN_SLOT_PROCESSES + OWN_PROCESSES
    if reward.pids < needed:
        raise ConfigError(f"reward {reward.name!r}: pids: {reward.pids} leaves too little room for its "
                          f"{per_version} slot processes (warm/workers) and what each sample may fork; set "
                          f"pids to at least {needed}, or lower warm")
    nproc, sample_memory = sample_limits(reward, slots, gvisor)
    return SlotPlan(slots=slots, default_warm=default_warm, sample_nproc=nproc, sample_memory=sample_memory)


class DockerSettings(BackendSettings):
    """``sandbox.docker:``: the images and containers of the docker backend."""

    base_image: str = Field(default="auto", description="auto (a slim official Python image where a registry "
                            "answers, else the offline Debian base), or any image with python3")
    runtime: Optional[str] = Field(default=None, description="container runtime, e.g. runsc for gVisor")
    network_mode: str = Field(default="bridge", description="docker network of rewards with network: true")
    pip_args: list[str] = Field(default_factory=list, description="extra pip download args (--index-url ...)")
    cache_dir: Optional[Path] = Field(default=None, description="wheelhouse and build cache; default ~/.cache")
    tmpfs_size: str = Field(default="64m", description="size of each slot's scratch tmpfs (a sample's files)")
    tmpfs_inodes: int = Field(default=8192, ge=64, description="files and directories a slot's scratch tmpfs may "
                              "hold (its size does not count them; runc enforces it, gVisor does not)")
    private_tmp: Literal["auto", "on", "off"] = Field(
        default="auto", description="a private, writable /tmp for every sample and every program it runs: auto "
        "(where the host allows it; else /tmp stays read-only, with a warning in the sandbox's log), on (a sandbox "
        "that cannot make it stops at start, saying why), off (read-only /tmp; the container gets no SYS_ADMIN)")
    apparmor_profile: Optional[str] = Field(
        default=None, pattern=f"^{apparmor.NAME_PATTERN}$",
        description="the AppArmor profile of the containers, on hosts that confine containers with "
        "AppArmor (Ubuntu, Debian): Docker's default one refuses the mounts of the private /tmp; `sudo rewardbox "
        "apparmor --install` loads rewardbox-sandbox, which allows them. Default: the engine's")
    system_packages_from: Literal["host", "build"] = Field(
        default="host", description="host: the host's apt-get downloads rewards' system_packages for the base image "
        "(the image build needs no network); build: the image build runs apt-get with the engine's default network")


def docker_settings(sandbox: SandboxSettings) -> DockerSettings:
    """``sandbox.docker``: as configured, else its defaults (``backend_settings("docker")``, typed)."""
    settings = sandbox.backend_settings("docker")
    assert isinstance(settings, DockerSettings)  # the settings type this backend registers
    return settings


def confines_with_apparmor(engine_info: dict) -> bool:
    """Whether the engine whose ``docker info`` this is confines its containers with AppArmor."""
    return any("name=apparmor" in option for option in engine_info.get("SecurityOptions") or ())


def apparmor_warning(engine_info: dict, settings: DockerSettings) -> Optional[str]:
    """What to tell a user whose engine confines containers with AppArmor under Docker's default profile, which
    refuses the mounts of the private /tmp (each sandbox then leaves /tmp read-only, or stops with private_tmp:
    on); None where that does not apply. ``engine_info``: the engine's ``docker info``."""
    confined = confines_with_apparmor(engine_info)
    named = settings.apparmor_profile not in (None, "docker-default")  # the engine's default, named
    if not confined or settings.private_tmp == "off" or named or is_gvisor(settings.runtime):
        return None
    return ("this Docker engine confines containers with AppArmor, and its default profile refuses the mounts of "
            "each sample's private /tmp (sandbox.docker.private_tmp): samples would find /tmp read-only. Load "
            "rewardbox's profile (`sudo rewardbox apparmor --install`) and set sandbox.docker.apparmor_profile: "
            "rewardbox-sandbox, or run sandboxes under gVisor (sandbox.docker.runtime: runsc)")


def engine_client(timeout: int = 120) -> docker.DockerClient:
    """A client for the engine named by the environment (DOCKER_HOST, else the local socket).

    Raises:
        BackendError: no engine answers, with how to start one.
    """
    try:
        client = docker.from_env(timeout=timeout)
        client.ping()
        return client
    except docker.errors.DockerException as e:
        raise BackendError(
            f"no Docker engine answers ({e}). Start one (`sudo dockerd &`, or scripts/setup.sh), or set "
            "`sandbox.backend: local` for trusted code."
        ) from e


def prune_images(client: docker.DockerClient) -> list[str]:
    """Removes sandbox images (``rewardbox-sandbox:*``) that no container uses. Returns their tags."""
    in_use = {c.image.id for c in client.containers.list(all=True, ignore_removed=True) if c.image is not None}
    removed = []
    for image in client.images.list(name=IMAGE_REPO):
        if image.id in in_use:
            continue
        for tag in image.tags:
            if tag.startswith(IMAGE_REPO + ":"):
                with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                    client.images.remove(tag, noprune=False)
                    removed.append(tag)
    return removed


class DockerBackend:
    """Hardened containers from images built per package set.

    Args:
        settings: the ``sandbox.docker`` section.
        client: an engine client to use (its owner closes it); by default one is made from the environment and
            closed by :meth:`close`.
        builder: the image builder; by default one on ``client`` with ``settings.cache_dir``.
        on_output: receives image-build progress lines.
    Raises:
        BackendError: no engine answers (with how to start one).
    """

    name = "docker"
    isolated = True

    def __init__(self, settings: Optional[DockerSettings] = None, client: Optional[docker.DockerClient] = None,
                 builder: Optional[ImageBuilder] = None, on_output: Optional[Callable[[str], None]] = None):
        self.settings = settings or DockerSettings()
        self._owns_client = client is None
        self.client = client or engine_client()
        kwargs: dict[str, Any] = {"on_output": on_output} if on_output else {}
        self.builder = builder or ImageBuilder(self.client, self.settings.cache_dir, **kwargs)
        self.run_id = uuid.uuid4().hex[:10]
        self.images: dict[tuple, str] = {}
        self._uid_blocks = random.SystemRandom()

    def prepare(self, rewards: Sequence[RewardSpec]) -> None:
        remove_leftovers(self.client, keep_run=self.run_id)
        warning = apparmor_warning(self.client.info(), self.settings)
        if warning:
            log.warning(warning)
        built = self.builder.ensure_images(rewards, self.settings)
        self.images = {packages: tag for packages, (tag, _) in built.items()}

    def create(self, reward: RewardSpec, replica: int) -> DockerSandbox:
        image = self.images.get(image_key(reward))
        if image is None:
            raise BackendError(f"reward {reward.name!r}: no image was prepared for its packages")
        uid = os.getuid()
        plan = slot_plan(reward, self.settings.runtime)
        # RLIMIT_NPROC counts a uid's processes across the host: each container draws uids of its own (slot uids,
        # then as many run uids: at most UID_BLOCK).
        first = SLOT_UID_BASE + UID_BLOCK * self._uid_blocks.randrange(1, 1 << 16)
        spec = ContainerSpec(
            image=image,
            name=f"rewardbox-{self.run_id}-{reward.name}-{replica}",
            # The host reaches the socket as the server's uid: the host user itself, or nobody for a root host.
            server_uid=NOBODY if uid == 0 else uid,
            slot_uids=(first, plan.slots),
            labels={
                LABEL: "1",
                f"{LABEL}.run": self.run_id,
                f"{LABEL}.reward": reward.name,
                f"{LABEL}.host": socket.gethostname(),
                f"{LABEL}.pid": str(os.getpid()),
            },
            environment=reward_environment(reward),
            mem_limit=reward.memory,
            nano_cpus=int(reward.cpus * 1e9),
            pids_limit=reward.pids,
            network_mode=self.settings.network_mode if reward.network else "none",
            tmpfs_size=self.settings.tmpfs_size,
            tmpfs_inodes=self.settings.tmpfs_inodes,
            # /dev/shm for rewards whose samples share processes anyway; never for an environment, whose episodes
            # are processes of their own (worker mode) that a shared /dev/shm would connect (red team of #41).
            shared_memory=reward.isolation == "worker" and reward.style != "environment",
            runtime=self.settings.runtime,
            default_warm=plan.default_warm,
            sample_nproc=plan.sample_nproc,
            sample_memory=plan.sample_memory,
            private_tmp=self.settings.private_tmp,
            apparmor_profile=self.settings.apparmor_profile,
        )
        return DockerSandbox(self.client, spec, name=f"{reward.name}-{replica}")

    def close(self) -> None:
        if self._owns_client:  # an injected client belongs to whoever made it
            with contextlib.suppress(Exception):
                self.client.close()


BACKEND = BackendType(
    name="docker",
    settings_type=DockerSettings,
    create=DockerBackend,
    isolated=True,
    summary="hardened containers (non-root, no capabilities, read-only root, no network unless asked)",
)

"""The ``docker`` backend: each replica of a reward is a hardened container.

Defaults: a non-root user, all capabilities dropped, ``no-new-privileges``, a read-only root filesystem with a
size-capped tmpfs on ``/tmp``, memory/CPU/pids limits from the reward's config, ``network_mode=none`` with gRPC
over a Unix socket in a bind-mounted directory (the only host path mounted). ``network: true`` gives egress
(``sandbox.network_mode``, bridge by default; no ports are published); ``secrets`` passes exactly the named
host environment variables to that reward's containers. Containers carry labels naming the run and the owning
process; containers of a run whose process is gone are removed at the next start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import docker
import docker.errors
from pydantic import Field

from ..errors import BackendError
from ..image import IMAGE_REPO, ImageBuilder
from ..spec import RewardSpec
from ..transport import Endpoint
from .base import BackendSettings, reward_environment
from .registry import BackendType

log = logging.getLogger("rewardbox")

LABEL = "rewardbox"
SOCKET_DIR_IN_CONTAINER = "/run/rewardbox"
UNPRIVILEGED = "65534:65534"  # nobody:nogroup


class DockerSettings(BackendSettings):
    """``sandbox.docker:``: the images and containers of the docker backend."""

    base_image: str = Field(default="auto", description="auto (a slim official Python image where a registry "
                            "answers, else the offline Debian base), or any image with python3")
    runtime: Optional[str] = Field(default=None, description="container runtime, e.g. runsc for gVisor")
    network_mode: str = Field(default="bridge", description="docker network of rewards with network: true")
    pip_args: list[str] = Field(default_factory=list, description="extra pip download args (--index-url ...)")
    cache_dir: Optional[Path] = Field(default=None, description="wheelhouse and build cache; default ~/.cache")
    tmpfs_size: str = Field(default="64m", description="size of each container's /tmp")


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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def remove_leftovers(client: docker.DockerClient, keep_run: Optional[str] = None) -> list[str]:
    """Removes rewardbox containers of this host whose owning process has exited. Returns their names."""
    removed = []
    host = socket.gethostname()
    for c in client.containers.list(all=True, filters={"label": LABEL}):
        labels = c.labels
        if labels.get(f"{LABEL}.host") != host or labels.get(f"{LABEL}.run") == keep_run:
            continue
        pid = int(labels.get(f"{LABEL}.pid", "0") or 0)
        if pid and _pid_alive(pid):
            continue
        with contextlib.suppress(docker.errors.NotFound):
            c.remove(force=True)
        socket_dir = labels.get(f"{LABEL}.socket_dir")
        if socket_dir and Path(socket_dir).name.startswith("rbx-"):
            shutil.rmtree(socket_dir, ignore_errors=True)
        removed.append(c.name)
    if removed:
        log.warning("removed %d container(s) left over from an earlier run: %s", len(removed), ", ".join(removed))
    return removed


def prune_images(client: docker.DockerClient) -> list[str]:
    """Removes sandbox images (``rewardbox-sandbox:*``) that no container uses. Returns their tags."""
    in_use = {c.image.id for c in client.containers.list(all=True) if c.image is not None}
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


@dataclass(frozen=True)
class ContainerSpec:
    """One sandbox container as the engine is asked to run it. The defaults are the hardening every sandbox gets;
    :meth:`DockerBackend.create` fills in the rest from the reward."""

    image: str
    name: str
    socket_dir: Path  # host directory bind-mounted at SOCKET_DIR_IN_CONTAINER; the server's socket is created there
    command: tuple = ("--listen", f"unix://{SOCKET_DIR_IN_CONTAINER}/grpc.sock")
    labels: dict = field(default_factory=dict)
    user: str = UNPRIVILEGED
    environment: dict = field(default_factory=dict)
    mem_limit: Optional[str] = None
    nano_cpus: Optional[int] = None
    pids_limit: Optional[int] = None
    network_mode: str = "none"
    tmpfs_size: str = "64m"
    runtime: Optional[str] = None

    def run_kwargs(self) -> dict:
        """Keyword arguments of docker-py's ``containers.run``."""
        kwargs = dict(
            image=self.image,
            command=list(self.command),
            name=self.name,
            labels={**self.labels, f"{LABEL}.socket_dir": str(self.socket_dir)},
            user=self.user,
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            read_only=True,
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={self.tmpfs_size},mode=1777"},
            mem_limit=self.mem_limit,
            memswap_limit=self.mem_limit,  # no swap beyond the memory limit
            nano_cpus=self.nano_cpus,
            pids_limit=self.pids_limit,
            network_mode=self.network_mode,
            volumes={str(self.socket_dir): {"bind": SOCKET_DIR_IN_CONTAINER, "mode": "rw"}},
            environment=dict(self.environment),
            init=True,  # reaps what user code forks
            ipc_mode="private",
        )
        if self.runtime:
            kwargs["runtime"] = self.runtime
        return {k: v for k, v in kwargs.items() if v is not None}


class DockerSandbox:
    def __init__(self, client: docker.DockerClient, spec: ContainerSpec, name: Optional[str] = None):
        self.name = name or spec.name
        self.spec = spec
        self._client = client
        self._container = None

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(f"unix://{self.spec.socket_dir / 'grpc.sock'}")

    @property
    def container(self):
        return self._container

    def start(self) -> None:
        self.spec.socket_dir.mkdir(parents=True, exist_ok=True)
        # The container's user (not root) creates the socket here.
        os.chmod(self.spec.socket_dir, 0o777)
        with contextlib.suppress(FileNotFoundError):
            (self.spec.socket_dir / "grpc.sock").unlink()
        try:
            self._container = self._client.containers.run(detach=True, **self.spec.run_kwargs())
        except docker.errors.APIError as e:
            raise BackendError(f"sandbox {self.name}: the engine refused to start the container: "
                               f"{e.explanation or e}") from e

    def alive(self) -> bool:
        if self._container is None:
            return False
        try:
            self._container.reload()
        except docker.errors.NotFound:
            return False
        return self._container.status == "running"

    def _remove(self) -> None:
        container, self._container = self._container, None
        if container is not None:
            with contextlib.suppress(docker.errors.NotFound):
                container.remove(force=True)

    def restart(self) -> None:
        self._remove()
        self.start()

    def stop(self) -> None:
        self._remove()
        shutil.rmtree(self.spec.socket_dir, ignore_errors=True)

    def logs(self, tail: int = 40) -> str:
        if self._container is None:
            return ""
        try:
            return self._container.logs(tail=tail).decode(errors="replace")
        except docker.errors.APIError:
            return ""


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
        kwargs = {"on_output": on_output} if on_output else {}
        self.builder = builder or ImageBuilder(self.client, self.settings.cache_dir, **kwargs)
        self.run_id = uuid.uuid4().hex[:10]
        self.images: dict[tuple, str] = {}

    def prepare(self, rewards: Sequence[RewardSpec]) -> None:
        remove_leftovers(self.client, keep_run=self.run_id)
        built = self.builder.ensure_images(rewards, self.settings)
        self.images = {packages: tag for packages, (tag, _) in built.items()}

    def create(self, reward: RewardSpec, replica: int) -> DockerSandbox:
        image = self.images.get(tuple(sorted(reward.packages)))
        if image is None:
            raise BackendError(f"reward {reward.name!r}: no image was prepared for its packages")
        uid = os.getuid()
        spec = ContainerSpec(
            image=image,
            name=f"rewardbox-{self.run_id}-{reward.name}-{replica}",
            socket_dir=Path(tempfile.mkdtemp(prefix="rbx-")),
            labels={
                LABEL: "1",
                f"{LABEL}.run": self.run_id,
                f"{LABEL}.reward": reward.name,
                f"{LABEL}.host": socket.gethostname(),
                f"{LABEL}.pid": str(os.getpid()),
            },
            # As the host user, so the host can use the socket it creates; never as root.
            user=UNPRIVILEGED if uid == 0 else f"{uid}:{os.getgid()}",
            environment=reward_environment(reward),
            mem_limit=reward.memory,
            nano_cpus=int(reward.cpus * 1e9),
            pids_limit=reward.pids,
            network_mode=self.settings.network_mode if reward.network else "none",
            tmpfs_size=self.settings.tmpfs_size,
            runtime=self.settings.runtime,
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

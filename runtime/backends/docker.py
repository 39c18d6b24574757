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
from pathlib import Path
from typing import Callable, Optional, Sequence

import docker
import docker.errors

from ..errors import BackendError
from ..image import ImageBuilder
from ..spec import RewardSpec, SandboxSettings
from .base import reward_environment

log = logging.getLogger("rewardbox")

LABEL = "rewardbox"
SOCKET_DIR_IN_CONTAINER = "/run/rewardbox"
UNPRIVILEGED = "65534:65534"  # nobody:nogroup


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
    from ..image import IMAGE_REPO

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


class DockerSandbox:
    def __init__(self, client: docker.DockerClient, name: str, run_kwargs: dict):
        self.name = name
        self._client = client
        self._run_kwargs = run_kwargs
        self._dir = Path(run_kwargs["labels"][f"{LABEL}.socket_dir"])
        self._container = None

    @property
    def address(self) -> str:
        return f"unix://{self._dir / 'grpc.sock'}"

    @property
    def container(self):
        return self._container

    def start(self) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        # The container's user (not root) creates the socket here.
        os.chmod(self._dir, 0o777)
        with contextlib.suppress(FileNotFoundError):
            (self._dir / "grpc.sock").unlink()
        try:
            self._container = self._client.containers.run(detach=True, **self._run_kwargs)
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
        shutil.rmtree(self._dir, ignore_errors=True)

    def logs(self, tail: int = 40) -> str:
        if self._container is None:
            return ""
        try:
            return self._container.logs(tail=tail).decode(errors="replace")
        except docker.errors.APIError:
            return ""


class DockerBackend:
    name = "docker"
    isolated = True

    def __init__(self, client: Optional[docker.DockerClient] = None, builder: Optional[ImageBuilder] = None,
                 on_output: Optional[Callable[[str], None]] = None):
        self.client = client or engine_client()
        self.builder = builder
        self._on_output = on_output
        self.run_id = uuid.uuid4().hex[:10]
        self.images: dict[tuple, str] = {}

    def prepare(self, rewards: Sequence[RewardSpec], settings: SandboxSettings) -> None:
        remove_leftovers(self.client, keep_run=self.run_id)
        if self.builder is None:
            kwargs = {"on_output": self._on_output} if self._on_output else {}
            self.builder = ImageBuilder(self.client, settings.cache_dir, **kwargs)
        self.images = {packages: tag for packages, (tag, _) in self.builder.ensure_images(rewards, settings).items()}

    def create(self, reward: RewardSpec, replica: int, settings: SandboxSettings) -> DockerSandbox:
        image = self.images.get(tuple(sorted(reward.packages)))
        if image is None:
            raise BackendError(f"reward {reward.name!r}: no image was prepared for its packages")
        environment = reward_environment(reward)
        socket_dir = tempfile.mkdtemp(prefix="rbx-")
        uid = os.getuid()
        run_kwargs = dict(
            image=image,
            command=["--listen", f"unix://{SOCKET_DIR_IN_CONTAINER}/grpc.sock"],
            name=f"rewardbox-{self.run_id}-{reward.name}-{replica}",
            labels={
                LABEL: "1",
                f"{LABEL}.run": self.run_id,
                f"{LABEL}.reward": reward.name,
                f"{LABEL}.host": socket.gethostname(),
                f"{LABEL}.pid": str(os.getpid()),
                f"{LABEL}.socket_dir": socket_dir,
            },
            # As the host user, so the host can use the socket it creates; never as root.
            user=UNPRIVILEGED if uid == 0 else f"{uid}:{os.getgid()}",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            read_only=True,
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={settings.tmpfs_size},mode=1777"},
            mem_limit=reward.memory,
            memswap_limit=reward.memory,
            nano_cpus=int(reward.cpus * 1e9),
            pids_limit=reward.pids,
            network_mode=settings.network_mode if reward.network else "none",
            volumes={socket_dir: {"bind": SOCKET_DIR_IN_CONTAINER, "mode": "rw"}},
            environment=environment,
            init=True,  # reaps what user code forks
            ipc_mode="private",
        )
        if settings.runtime:
            run_kwargs["runtime"] = settings.runtime
        return DockerSandbox(self.client, f"{reward.name}-{replica}", run_kwargs)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()

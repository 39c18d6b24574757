"""Sandbox containers: how one is specified (:class:`ContainerSpec`), run (:class:`DockerSandbox`), reached
(:class:`SocketVolume`) and cleaned up after a run that died (:func:`remove_leftovers`).

What a container gets (the docker backend's hardening):

- it starts as root holding only SETUID, SETGID and KILL (``cap_drop: ALL`` otherwise, ``no-new-privileges``): the
  sandbox's supervisor needs them to run slot processes under uids of their own; the gRPC server drops to
  ``server_uid`` and slot processes hold no capability at all;
- a read-only root filesystem (``/tmp`` included); each slot uid has its own tmpfs (``/tmp/slot-<uid>``, mode
  0700, ``tmpfs_size``), so no sample can write where another can read, and so does the run uid paired with each
  slot (the programs a reward runs); no SysV IPC or message queues;
- ``private_tmp`` (default ``auto``): each slot process and program sees its own tmpfs on ``/tmp``, in a mount
  namespace of its own (``sandbox_image/confine/private_tmp.py``). For that the container also gets ``SYS_ADMIN``, which
  only opens Docker's seccomp profile to ``unshare``/``mount``: under runc the sandbox drops it in its first process
  (docker-init, PID 1, keeps it: it only reaps and forwards signals, and no sandbox uid can signal it), and
  reward code is refused namespaces and mounts by the sandbox's own seccomp filter. Where the host confines
  containers with AppArmor, Docker's default profile refuses those mounts: ``apparmor_profile`` names one that
  allows them (``rewardbox.deploy.apparmor``);
- the gRPC socket's directory is a 1 MiB ``nosuid,nodev,noexec`` tmpfs volume owned by the server uid (mode 0700):
  nothing a container writes lands on host disk, and no sample can reach the socket;
- memory (no swap), CPU and pids limits; no network unless the reward asks; no ``/dev/shm`` under
  ``isolation: sample``; logs rotated and capped; ``init`` reaps orphans.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import docker
import docker.errors
import docker.types

from ..errors import BackendError
from ..scoring.transport import Endpoint

log = logging.getLogger("rewardbox")

LABEL = "rewardbox"
SOCKET_DIR_IN_CONTAINER = "/run/rewardbox"
SOCKET_NAME = "grpc.sock"
SLOT_DIR_PREFIX = "/tmp/slot-"  # the sandbox's supervisor expects each slot's tmpfs here
PRIVATE_TMP_ROOTS = "/tmp/rewardbox-roots"  # gVisor: where the sandbox builds each uid's root (private_tmp.ROOTS)
CAPABILITIES = ("SETUID", "SETGID", "KILL")
IPC_OFF = {"kernel.shmmni": "0", "kernel.msgmni": "0", "kernel.sem": "0 0 0 0", "fs.mqueue.queues_max": "0"}
# No TCP connection outlives its processes in TIME_WAIT (60 s, in the container's network namespace, held by no
# process: no kill reaches it): it would keep its port from a later sample that binds it (red team 12: an innocent
# test server's bind() failed with EADDRINUSE in every batch after a hostile closed 4 connections). Runc; gVisor's
# network stack ignores it. Not with network_mode host (a network: true reward's, where an operator chose it).
NO_TIME_WAIT = {"net.ipv4.tcp_max_tw_buckets": "0"}
LOG_MAX_SIZE, LOG_MAX_FILES = "4m", "2"


@dataclass(frozen=True)
class ContainerSpec:
    """One sandbox container as the engine is asked to run it. The defaults are the hardening every sandbox gets;
    :meth:`.docker.DockerBackend.create` fills in the rest from the reward."""

    image: str
    name: str
    server_uid: int = 65534
    # (first, count): uids of the slot processes, each with its own tmpfs; the next ``count`` uids are those of the
    # programs their reward code runs (rewardbox.sandbox.run), one per slot, each with its own tmpfs too.
    slot_uids: tuple = ()
    command: Optional[tuple] = None  # default: the sandbox server with the uids above
    labels: dict = field(default_factory=dict)
    environment: dict = field(default_factory=dict)
    mem_limit: Optional[str] = None
    nano_cpus: Optional[int] = None
    pids_limit: Optional[int] = None
    network_mode: str = "none"
    tmpfs_size: str = "64m"
    # Files (inodes) per slot tmpfs: a tmpfs's size does not count them, and each costs the container's memory
    # (about 5 KiB of kernel memory for an empty file, measured).
    tmpfs_inodes: int = 8192
    shared_memory: bool = False  # /dev/shm (isolation: worker only: every sample would share it)
    runtime: Optional[str] = None
    default_warm: Optional[int] = None
    sample_nproc: Optional[int] = None  # RLIMIT_NPROC of each slot uid
    sample_memory: Optional[int] = None  # RLIMIT_AS of each slot process, in bytes (gVisor)
    # Where no tmpfs can be mounted per slot (a Kubernetes pod): the slots' directories are made under this one
    # directory (mode 0711, root's) by the sandbox itself. In Docker it is one tmpfs, world-writable as a pod's
    # emptyDir is, so a container can stand in for a pod in tests.
    slot_root: Optional[str] = None
    # A private /tmp for every sample and program (sandbox_image/confine/private_tmp.py): "auto" (where the host allows
    # it), "on" (a sandbox that cannot make it stops at start) or "off" (/tmp is read-only, no SYS_ADMIN at all).
    private_tmp: str = "off"
    # The containers' AppArmor profile (None: the engine's, docker-default, which refuses the private /tmp's mounts
    # on hosts that enforce AppArmor: rewardbox.deploy.apparmor).
    apparmor_profile: Optional[str] = None

    def capabilities(self) -> list:
        """What the container starts with. The private /tmp needs SYS_ADMIN in the container's set only so that
        Docker's seccomp profile lets unshare and mount through: under runc the sandbox's first process drops it
        before anything runs; under gVisor it is gVisor's own and the host kernel never sees it."""
        if not self.slot_uids or self.private_tmp == "off":
            return list(CAPABILITIES)
        return list(CAPABILITIES) + ["SYS_ADMIN"] + (["SYS_CHROOT"] if is_gvisor(self.runtime) else [])

    def server_command(self) -> list:
        if self.command is not None:
            return list(self.command)
        command = ["--listen", f"unix://{SOCKET_DIR_IN_CONTAINER}/{SOCKET_NAME}", "--server-uid", str(self.server_uid)]
        if self.slot_uids:
            first, count = self.slot_uids
            command += ["--slot-uids", f"{first}-{first + count - 1}",
                        "--run-uids", f"{first + count}-{first + 2 * count - 1}"]
            if not is_gvisor(self.runtime):  # a Linux kernel: kill(-1) cannot race fork (see slot.kill_uid)
                command.append("--atomic-kill")
            if self.private_tmp != "off":
                command += ["--private-tmp", "chroot" if is_gvisor(self.runtime) else "userns"]
                if self.private_tmp == "on":
                    command.append("--require-private-tmp")
        if self.slot_root:
            command += ["--slot-root", self.slot_root]
        if self.sample_nproc:
            command += ["--sample-nproc", str(self.sample_nproc)]
        if self.sample_memory:
            command += ["--sample-memory", str(self.sample_memory)]
        if self.default_warm:
            command += ["--default-warm", str(self.default_warm)]
        return command

    def host_pids_limit(self) -> Optional[int]:
        """The container's limit on host processes. Under gVisor the engine counts the sandbox kernel's threads and
        one host stub per sandboxed process (about 10 each, measured): the limit inside the sandbox is then held by
        RLIMIT_NPROC per slot uid, and this one only caps the whole."""
        if self.pids_limit is None or not is_gvisor(self.runtime):
            return self.pids_limit
        return 256 + 16 * self.pids_limit

    def slot_tmpfs(self) -> dict:
        first, count = self.slot_uids or (0, 0)
        roots = {PRIVATE_TMP_ROOTS: "rw,nosuid,nodev,size=1m,mode=0700"} \
            if self.slot_uids and self.private_tmp != "off" and is_gvisor(self.runtime) else {}
        if self.slot_root:
            return roots | {self.slot_root: f"rw,nosuid,nodev,exec,size={self.tmpfs_size},mode=0777,"  # as an emptyDir
                                    f"nr_inodes={self.tmpfs_inodes * 2 * count}"}
        # Docker mounts a tmpfs noexec unless told otherwise: the programs' directories hold compiled programs.
        return roots | {f"{SLOT_DIR_PREFIX}{uid}": f"rw,nosuid,nodev,{'exec,' if uid >= first + count else ''}"
                                           f"size={self.tmpfs_size},nr_inodes={self.tmpfs_inodes},mode=0700,"
                                           f"uid={uid},gid={uid}"
                for uid in range(first, first + 2 * count)}

    def run_kwargs(self, socket_mount: dict) -> dict:
        """Keyword arguments of docker-py's ``containers.run``; ``socket_mount`` is the socket directory's volume."""
        kwargs = dict(
            image=self.image,
            command=self.server_command(),
            name=self.name,
            labels=dict(self.labels),
            user="0:0",
            cap_drop=["ALL"],
            cap_add=self.capabilities(),
            security_opt=["no-new-privileges"] + ([f"apparmor={self.apparmor_profile}"] if self.apparmor_profile
                                                  else []),
            read_only=True,
            # /tmp stays the image's directory on the read-only root: nobody can write there (a tmpfs mounted on
            # it, typed or not, gets the image directory's 1777 copied over its mode). Slots write their own.
            tmpfs=self.slot_tmpfs(),
            # No SysV IPC objects or POSIX message queues at all (runc; gVisor ignores these and the slots'
            # cleanup removes what a sample created there), and no TCP TIME_WAIT in a network namespace of its own
            # (another's, the host's included, is not the container's to set).
            sysctls=IPC_OFF | ({} if self.network_mode == "host" or self.network_mode.startswith("container:")
                               else NO_TIME_WAIT),
            mem_limit=self.mem_limit,
            memswap_limit=self.mem_limit,  # no swap beyond the memory limit
            nano_cpus=self.nano_cpus,
            pids_limit=self.host_pids_limit(),
            network_mode=self.network_mode,
            volumes=socket_mount,
            environment=dict(self.environment),
            init=True,  # reaps what user code forks and leaves
            ipc_mode="private" if self.shared_memory else "none",
            log_config=docker.types.LogConfig(type="json-file",
                                              config={"max-size": LOG_MAX_SIZE, "max-file": LOG_MAX_FILES}),
        )
        if self.runtime:
            kwargs["runtime"] = self.runtime
        return {k: v for k, v in kwargs.items() if v is not None}


def is_gvisor(runtime: Optional[str]) -> bool:
    return runtime is not None and "runsc" in runtime


class SocketVolume:
    """The directory holding a sandbox's gRPC socket: a 1 MiB ``nosuid,nodev,noexec`` tmpfs volume owned by the
    server uid, mode 0700. The host reaches it through the volume's mount point (root) by a short symlink (Unix
    socket paths are limited to 107 bytes). A host that is not root cannot enter the engine's volume directory:
    there the socket directory is a bind mount of a private directory on a tmpfs ($XDG_RUNTIME_DIR or /dev/shm)."""

    def __init__(self, client: docker.DockerClient, name: str, uid: int, labels: dict):
        self.client, self.name, self.uid, self.labels = client, name, uid, labels
        self.link_dir = Path(tempfile.mkdtemp(prefix="rbx-"))
        self.bind_dir: Optional[Path] = None
        self.volume: Optional[docker.models.volumes.Volume] = None

    @property
    def path(self) -> Path:
        """The socket's directory as the host sees it."""
        return self.link_dir / "s"

    def create(self) -> None:
        if self.volume is not None or self.bind_dir is not None:
            return
        if os.geteuid() == 0:
            options = f"size=1m,mode=0700,uid={self.uid},gid={self.uid},nosuid,nodev,noexec"
            try:
                self.volume = self.client.volumes.create(self.name, driver="local", labels=self.labels, driver_opts={
                    "type": "tmpfs", "device": "tmpfs", "o": options})
            except docker.errors.APIError as e:
                raise BackendError(f"cannot create the socket volume {self.name}: {e.explanation or e}") from e
            target = self.volume.attrs["Mountpoint"]
        else:
            base = os.environ.get("XDG_RUNTIME_DIR") or "/dev/shm"
            self.bind_dir = Path(tempfile.mkdtemp(prefix="rbx-sock-", dir=base))
            os.chmod(self.bind_dir, stat.S_IRWXU)
            target = str(self.bind_dir)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
        self.path.symlink_to(target)

    def mount(self) -> dict:
        source = self.volume.name if self.volume is not None else str(self.bind_dir)
        return {source: {"bind": SOCKET_DIR_IN_CONTAINER, "mode": "rw"}}

    def remove(self) -> None:
        if self.volume is not None:
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                self.volume.remove(force=True)
            self.volume = None
        if self.bind_dir is not None:
            shutil.rmtree(self.bind_dir, ignore_errors=True)
            self.bind_dir = None
        shutil.rmtree(self.link_dir, ignore_errors=True)


class DockerSandbox:
    def __init__(self, client: docker.DockerClient, spec: ContainerSpec, name: Optional[str] = None,
                 socket_volume: Optional[SocketVolume] = None):
        self.name = name or spec.name
        self.spec = spec
        self._client = client
        self.socket_volume = socket_volume or SocketVolume(
            client, f"rbx-{os.urandom(5).hex()}", spec.server_uid, {LABEL: "1", **spec.labels})
        self._container = None

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(f"unix://{self.socket_volume.path / SOCKET_NAME}")

    @property
    def container(self):
        return self._container

    def start(self) -> None:
        self.socket_volume.create()
        try:
            self._container = self._client.containers.run(detach=True,
                                                          **self.spec.run_kwargs(self.socket_volume.mount()))
        except docker.errors.APIError as e:
            said = str(e.explanation or e)
            hint = ""
            if self.spec.apparmor_profile and "apparmor" in said.lower():
                hint = (f" (sandbox.docker.apparmor_profile names {self.spec.apparmor_profile!r}: is it loaded on the "
                        "engine's host? `sudo rewardbox apparmor --install` loads rewardbox-sandbox there)")
            raise BackendError(f"sandbox {self.name}: the engine refused to start the container: {said}{hint}") from e

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
        self.socket_volume.remove()

    def logs(self, tail: int = 40) -> str:
        if self._container is None:
            return ""
        try:
            return self._container.logs(tail=tail).decode(errors="replace")
        except docker.errors.APIError:
            return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _dead_run(labels: dict, host: str, keep_run: Optional[str]) -> bool:
    if labels.get(f"{LABEL}.host") != host or labels.get(f"{LABEL}.run") == keep_run:
        return False
    pid = int(labels.get(f"{LABEL}.pid", "0") or 0)
    return not (pid and _pid_alive(pid))


def remove_leftovers(client: docker.DockerClient, keep_run: Optional[str] = None) -> list[str]:
    """Removes rewardbox containers (and their socket volumes) of this host whose owning process has exited.
    Returns the containers' names."""
    removed = []
    host = socket.gethostname()
    for c in client.containers.list(all=True, filters={"label": LABEL}, ignore_removed=True):
        if _dead_run(c.labels, host, keep_run):
            with contextlib.suppress(docker.errors.NotFound):
                c.remove(force=True)
            removed.append(c.name)
    for volume in client.volumes.list(filters={"label": LABEL}):
        if _dead_run(volume.attrs.get("Labels") or {}, host, keep_run):
            with contextlib.suppress(docker.errors.NotFound, docker.errors.APIError):
                volume.remove(force=True)
    if removed:
        log.warning("removed %d container(s) left over from an earlier run: %s", len(removed), ", ".join(removed))
    return removed

"""The ``ray`` backend: each replica of a reward is a Ray actor that serves the reward from a hardened container on
its own node's Docker engine.

    sandbox:
      backend: ray
      ray:
        address: auto            # the running cluster (`ray start --head`); or ray://HOST:10001, or HOST:6379
        docker: {runtime: runsc} # the node-side sandboxes: sandbox.docker's settings

Ray places and restarts processes; it isolates nothing. So an actor is only a carrier: on its node it runs what
``rewardbox serve`` runs (:func:`rewardbox.serve.service.serve`: the docker backend's images, hardening and per-sample
isolation) for one replica of one reward, on a TCP port with TLS and a token, and the trainer scores on it like
on a shared service.

- **Placement.** One actor per replica, with the reward's ``cpus`` and ``memory`` as its Ray resources (or
  ``num_cpus``/``memory`` here), Ray's ``SPREAD`` strategy (replicas of a reward go to different nodes when the
  cluster has them; ``strategy: pack`` keeps them together), optional custom ``resources`` and a
  ``label_selector`` to pick nodes.
- **Images** are built on each node that runs a replica (once per node and package set: the image cache is the
  node's), or pulled from the registry ``docker.base_image`` names.
- **Security.** Every run makes its own CA, a server certificate (for the name :data:`SERVER_NAME`; the trainer
  checks it whatever the node's address), a client certificate the actors require (mutual TLS: a peer of the
  node's network without it is refused in the TLS handshake, before HTTP/2) and a token. They reach the actors as
  actor arguments, so through Ray's object store: whoever can run code on the cluster can read them, as they can
  run code on its nodes anyway.
- **Faults.** A replica whose actor, container or node dies fails health; the trainer's client retries its
  unscored samples (:mod:`rewardbox.scoring.client`) and the backend replaces it: the old actor is killed and a new one
  is placed on a live node (Ray restarts nothing by itself: ``max_restarts`` is 0, so the replacement is ours and
  happens once). A dead actor's container is removed by the next actor that starts on its node (its owner process
  is gone: :func:`rewardbox.backends.containers.remove_leftovers`), or when the container's node goes down with it.
- **The trainer's own node.** The trainer holds the run: if its node dies, the run dies, and its actors (owned by
  the trainer's driver, not detached) die with it; their containers are removed by the next run on their nodes.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import fcntl
import logging
import os
import secrets
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import docker.utils
from pydantic import Field

from ..errors import BackendError, ConfigError, ImageBuildError, RewardLoadError
from ..registry import BackendType
from ..scoring.transport import Endpoint, tcp_answers
from ..spec import RewardSpec, is_local_package
from .base import BackendSettings, reward_environment
from .docker import DockerSettings

log = logging.getLogger("rewardbox")

SERVER_NAME = "rewardbox-ray"  # the name every actor's certificate carries
CLIENT_NAME = "rewardbox-ray-trainer"  # the name of the trainer's client certificate
NAMESPACE = "rewardbox"
NODE_LOCK = "ray-build.lock"  # in the node's image cache: one build of an image per node at a time


class RaySettings(BackendSettings):
    """``sandbox.ray:``: which Ray cluster, and where on it the replicas go."""

    address: str = Field(default="auto", description="auto: the cluster running here (`ray start --head`); or "
                         "ray://HOST:10001 (Ray Client), or HOST:6379 (the head's GCS)")
    strategy: Literal["spread", "pack"] = Field(default="spread", description="spread: replicas of a reward on "
                                                "different nodes when the cluster has them; pack: together")
    num_cpus: Optional[float] = Field(default=None, gt=0, description="Ray CPUs per replica (default: the reward's "
                                      "`cpus`)")
    memory: Optional[str] = Field(default=None, pattern=r"^\d+(\.\d+)?[bkmgBKMG]?$",
                                  description="Ray memory per replica (default: the reward's `memory`)")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per replica, e.g. "
                                        "{reward_node: 1} to use only nodes started with --resources")
    label_selector: dict[str, str] = Field(default_factory=dict, description="Ray node labels a replica's node "
                                           "must have, e.g. {pool: rewards}")
    start_timeout_s: float = Field(default=900.0, gt=0, description="how long a replica may take to start on its "
                                   "node, image build included")
    docker: DockerSettings = Field(default_factory=DockerSettings, description="the node-side sandboxes: "
                                   "sandbox.docker's settings, applied on each node")


@dataclass(frozen=True)
class RunCertificates:
    """A run's CA, the actors' server certificate (chain and key) and the trainer's client certificate (chain and
    key), PEM: the actors require the client certificate (mutual TLS), so a peer without it never reaches HTTP/2."""

    ca: bytes
    server: bytes
    server_key: bytes
    client: bytes
    client_key: bytes


def run_certificates() -> RunCertificates:
    """A new CA and, signed by it, a server certificate for :data:`SERVER_NAME` and a client certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=30))
    pem = serialization.Encoding.PEM

    def certificate(subject: str, key, issuer: str, issuer_key, ca: bool):
        builder = (x509.CertificateBuilder()
                   .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
                   .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(valid[0]).not_valid_after(valid[1])
                   .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if not ca:
            builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def private(key) -> bytes:
        return key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    ca_key, key, client_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca = certificate("rewardbox run CA", ca_key, "rewardbox run CA", ca_key, ca=True).public_bytes(pem)
    server = certificate(SERVER_NAME, key, "rewardbox run CA", ca_key, ca=False).public_bytes(pem)
    client = certificate(CLIENT_NAME, client_key, "rewardbox run CA", ca_key, ca=False).public_bytes(pem)
    return RunCertificates(ca, server + ca, private(key), client + ca, private(client_key))


def _check_reachable(address: str) -> None:
    """An explicit address that nothing answers at fails at once (Ray itself would retry it for minutes).

    Raises:
        BackendError: naming the address and how to start a cluster.
    """
    if address != "auto" and not tcp_answers(address, timeout_s=5):
        raise BackendError(
            f"sandbox.ray.address is {address!r}, and nothing answers there. Start the cluster's head there "
            "(`ray start --head`, which listens on 6379; Ray Client on 10001), or fix the address.")


class RewardServer:
    """The actor: one replica of one reward, served on this node like ``rewardbox serve`` serves it."""

    def __init__(self, reward: dict, filename: str, source: str, docker: dict, certificates: RunCertificates,
                 token: str, environment: dict):
        import ray

        from ..spec import parse_config

        self.node_ip = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.folder = Path(tempfile.mkdtemp(prefix="rewardbox-ray-"))
        (self.folder / filename).write_text(source)  # its own name: errors name the user's file
        os.environ.update(environment)  # the reward's secrets and env: read by its sandbox (reward_environment)
        self.config = parse_config({"sandbox": {"backend": "docker", "docker": docker},
                                    "rewards": [{**reward, "source": filename, "replicas": 1}]}, self.folder)
        self.certificates, self.token = certificates, token
        self.port: Optional[int] = None
        self.error: Optional[tuple[str, str]] = None  # (the exception's type, its message)
        self.sandboxes: Any = None
        self.ready = threading.Event()
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.stopping: Optional[asyncio.Event] = None
        self.thread = threading.Thread(target=self._run, name="rewardbox-serve", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from ..serve.service import ServiceSecurity, limit_malloc_arenas, serve

        limit_malloc_arenas()  # as `rewardbox serve` does: its limits under hostile peers hold here too

        async def main() -> None:
            self.loop, self.stopping = asyncio.get_running_loop(), asyncio.Event()
            c = self.certificates
            security = ServiceSecurity(c.server, c.server_key, self.token, client_ca=c.ca)
            await serve(self.config, "0.0.0.0:0", security, on_ready=self._up,
                        stop=self.stopping, drain_grace_s=5.0)

        try:
            from ..backends.docker import docker_settings
            from ..images.image import default_cache_dir

            cache = Path(docker_settings(self.config.sandbox).cache_dir or default_cache_dir()).expanduser()
            cache.mkdir(parents=True, exist_ok=True)
            with open(cache / NODE_LOCK, "w") as lock:  # replicas starting together on a node build once
                fcntl.flock(lock, fcntl.LOCK_EX)
                from ..backends.docker import DockerBackend

                backend = DockerBackend(docker_settings(self.config.sandbox))
                try:
                    backend.prepare(self.config.rewards)
                finally:
                    backend.close()
            asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - reported to the trainer through address()
            self.error = (type(e).__name__, str(e))
        finally:
            self.ready.set()

    def _up(self, sandboxes: Any, port: int) -> None:
        self.sandboxes, self.port = sandboxes, port
        self.ready.set()

    def address(self, timeout_s: float) -> dict:
        """Where it serves once the service answers (node address, port, node id, this process's pid: its
        container's owner), or why it could not start (``error``: the exception's type and message)."""
        if not self.ready.wait(timeout_s):
            return {"error": ("TimeoutError", f"not serving after {timeout_s:g}s")}
        if self.port is None:
            return {"error": self.error or ("RuntimeError", "the service stopped")}
        return {"ip": self.node_ip, "port": self.port, "node_id": self.node_id, "pid": os.getpid()}

    def logs(self, tail: int) -> str:
        """The last output of this replica's container."""
        if self.sandboxes is None:
            return ""
        return "\n".join(r.sandbox.logs(tail) for rs in self.sandboxes.replicas.values() for r in rs)

    def ping(self) -> bool:
        return self.port is not None and self.thread.is_alive()

    def stop(self) -> None:
        if self.loop is not None and self.stopping is not None:
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.stopping.set)
        self.thread.join(timeout=60)


class RaySandbox:
    """One replica: an actor somewhere on the cluster. Its endpoint changes when it is replaced on another node."""

    def __init__(self, backend: "RayBackend", reward: RewardSpec, replica: int):
        self.backend, self.reward, self.replica = backend, reward, replica
        self.name = f"{reward.name}-{replica}"
        self.actor: Any = None
        self.node_id = ""
        self.pid = 0  # the actor's process on its node: the owner its container is labelled with
        self._endpoint: Optional[Endpoint] = None
        self.replaced = 0

    @property
    def endpoint(self) -> Endpoint:
        if self._endpoint is None:
            raise BackendError(f"replica {self.name} has not started")
        return self._endpoint

    def start(self) -> None:
        import ray

        self.actor = self.backend.make_actor(self.reward, self.replica, self.replaced)
        timeout = self.backend.settings.start_timeout_s
        try:
            where = ray.get(self.actor.address.remote(timeout), timeout=timeout + 30)
        except Exception as e:  # noqa: BLE001 - RayActorError (its node died), GetTimeoutError (not placed)
            where = {"error": (type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")}
        if "error" in where:
            self._kill()
            kind, message = where["error"]
            error = _ERRORS.get(kind, BackendError)
            if error is BackendError:
                message = (f"reward {self.reward.name!r}: replica {self.replica} did not start on the Ray cluster: "
                           f"{kind}: {message}")
            raise error(message)
        ip, port, self.node_id, self.pid = where["ip"], where["port"], where["node_id"], where["pid"]
        c = self.backend.certificates
        self._endpoint = Endpoint(f"{ip}:{port}", c.ca, self.backend.token, SERVER_NAME, c.client, c.client_key)
        log.info("reward %s: replica %d serves on %s:%d (Ray node %s)", self.reward.name, self.replica, ip, port,
                 self.node_id[:12])

    def alive(self) -> bool:
        import ray

        if self.actor is None:
            return False
        try:
            return bool(ray.get(self.actor.ping.remote(), timeout=10))
        except Exception:  # noqa: BLE001 - the actor or its node is gone, or it does not answer
            return False

    def restart(self) -> None:
        """Replaces the replica: a new actor on a live node (the same one when it is still there)."""
        self.stop()
        self.replaced += 1
        self.start()

    def _kill(self) -> None:
        import ray

        if self.actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(self.actor, no_restart=True)
            self.actor = None

    def stop(self) -> None:
        import ray

        if self.actor is not None:
            with contextlib.suppress(Exception):
                ray.get(self.actor.stop.remote(), timeout=90)
        self._kill()

    def logs(self, tail: int = 40) -> str:
        import ray

        if self.actor is not None:
            with contextlib.suppress(Exception):
                return ray.get(self.actor.logs.remote(tail), timeout=10)
        where = f"Ray node {self.node_id}" if self.node_id else "its Ray node"
        return f"(the replica is gone; its output is in the Ray logs of {where}: `ray logs` there)"


# What a replica's start-up failure on its node is raised as here (by the name of its type there).
_ERRORS = {"RewardLoadError": RewardLoadError, "ImageBuildError": ImageBuildError, "ConfigError": ConfigError}


class RayBackend:
    """Replicas as Ray actors across a cluster's nodes.

    Raises:
        BackendError: Ray is not installed, or no cluster answers at ``address`` (saying how to start one).
    """

    name = "ray"
    isolated = True  # each actor's sandbox is a hardened container (Ray itself isolates nothing)

    def __init__(self, settings: Optional[RaySettings] = None):
        self.settings = settings or RaySettings()
        try:
            import ray
        except ImportError:
            raise BackendError("sandbox.backend is ray, but Ray is not installed here: pip install 'rewardbox[ray]' "
                               "(on every node of the cluster too)") from None
        self._owns_connection = not ray.is_initialized()
        if self._owns_connection:
            _check_reachable(self.settings.address)
            try:
                ray.init(address=self.settings.address, namespace=NAMESPACE, log_to_driver=False,
                         logging_level=logging.WARNING)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise BackendError(
                    f"sandbox.ray.address is {self.settings.address!r}, and no Ray cluster answers there ({e}). "
                    "Start one: `ray start --head` on this machine (then `ray start --address=HEAD_IP:6379` on each "
                    "other node), or set sandbox.ray.address to a running cluster's address.") from None
        self.certificates = run_certificates()
        self.token = secrets.token_urlsafe(32)
        self.run_id = secrets.token_hex(4)
        self._actor_class = ray.remote(RewardServer)

    def prepare(self, rewards: Sequence[RewardSpec]) -> None:
        """Images are built on the nodes, as replicas start there. Checks what cannot work across machines."""
        for reward in rewards:
            local = [p for p in reward.packages if is_local_package(p)]
            if local:
                raise ConfigError(f"reward {reward.name!r}: packages {local} are folders of this machine, which the "
                                  "other nodes of a Ray cluster do not have: publish them to an index, or use the "
                                  "docker backend")

    def make_actor(self, reward: RewardSpec, replica: int, generation: int) -> Any:
        """Starts the actor of one replica (its constructor runs on the node Ray picks)."""
        source = Path(reward.source).read_text()  # absolute: RewardSandboxes hands backends resolved sources
        options: dict[str, Any] = {
            "name": f"rewardbox-{self.run_id}-{reward.name}-{replica}-{generation}",
            "num_cpus": self.settings.num_cpus or reward.cpus,
            "memory": docker.utils.parse_bytes(self.settings.memory or reward.memory),
            "max_restarts": 0,  # a replacement is the backend's (RaySandbox.restart): once, on a live node
            "max_concurrency": 4,  # address() waits while ping() and stop() answer
            "scheduling_strategy": "SPREAD" if self.settings.strategy == "spread" else "DEFAULT",
        }
        if self.settings.resources:
            options["resources"] = dict(self.settings.resources)
        if self.settings.label_selector:
            options["label_selector"] = dict(self.settings.label_selector)
        spec = reward.model_dump(mode="json", exclude={"source"})
        # The named secrets' values, read here, become the actor's environment, where its sandbox reads them.
        secrets_ = {k: v for k, v in reward_environment(reward).items() if k in reward.secrets}
        return self._actor_class.options(**options).remote(
            spec, Path(reward.source).name, source, self.settings.docker.model_dump(mode="json"), self.certificates,
            self.token, secrets_)

    def create(self, reward: RewardSpec, replica: int) -> RaySandbox:
        return RaySandbox(self, reward, replica)

    def close(self) -> None:
        if self._owns_connection:
            import ray

            with contextlib.suppress(Exception):
                ray.shutdown()


BACKEND = BackendType(
    name="ray",
    settings_type=RaySettings,
    create=RayBackend,
    isolated=True,
    summary="replicas as Ray actors spread across a cluster's nodes, each serving a hardened container on its "
            "node's Docker engine (TLS and a token per run); replaced on another node when one dies",
)

"""``rewardbox deploy kubernetes``: a config's rewards as shared services (``rewardbox serve``) on a Kubernetes
cluster, as manifests for ``kubectl apply -f -``.

Each reward gets a Deployment of ``replicas`` pods, each pod holding two containers that share the sandbox's socket
in an in-memory emptyDir:

- ``sandbox``: the reward's sandbox image running the sandbox server, hardened by its security context as the
  docker backend hardens a container (root holding only SETUID, SETGID and KILL, read-only root, seccomp, memory
  and CPU limits, slot directories under an emptyDir made by the server itself: ``--slot-root``);
- ``gateway``: the service image running ``rewardbox serve`` attached to that socket (``backend: attached``), the
  pod's only way in: TLS and a bearer token on port 50051.

Beside it: a headless Service (trainers' gRPC clients round-robin over the pods' addresses), a NetworkPolicy
(ingress from trainer pods only; egress only for ``network: true``) and a ConfigMap (the gateway's config and the
reward's file).

:func:`manifests` is pure (the config and image references in, manifest dicts out); :func:`render` learns the
image tags from the image builder (what ``rewardbox build --push`` pushes) and writes the YAML.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional

import docker.errors
import docker.utils
import yaml

from ..backends.containers import SOCKET_DIR_IN_CONTAINER, SOCKET_NAME, ContainerSpec, is_gvisor
from ..backends.docker import NOBODY, docker_settings, slot_plan
from ..errors import ConfigError
from ..images.image import image_key, registry_reference
from ..serve.service import DRAIN_GRACE_S, TOKEN_ENV
from ..spec import RewardboxConfig, RewardSpec, SandboxSettings

PORT = 50051
PREFIX = "rewardbox-"
SCRATCH = "/scratch"
CONFIG_DIR = "/etc/rewardbox/config"
TLS_DIR = "/etc/rewardbox/tls"
CLIENT_CA_DIR = "/etc/rewardbox/client-ca"
# Slot uids inside a pod: the docker backend draws a random block per container because RLIMIT_NPROC counts a uid
# across the host; a pod's manifest is fixed, so every pod uses this block.
POD_SLOT_UID_BASE = 20000
TOKEN_SECRET = "rewardbox-token"
TLS_SECRET = "rewardbox-tls"
CLIENT_CA_SECRET = "rewardbox-client-ca"  # with --client-certificates: the CA that signs the trainers' certificates
REWARD_SECRETS = "rewardbox-secrets"
DEFAULT_TRAINER_LABEL = "rewardbox.dev/trainer=true"
SECRET_MODE = 0o440  # root:65534 (fsGroup): the gateway reads its files, nobody else
# The gateway relays batches; it runs no reward code. Requests equal limits (Guaranteed QoS, as the sandbox).
GATEWAY_RESOURCES = {"cpu": "500m", "memory": "512Mi"}
DEFAULT_CAPABILITIES = ("SETUID", "SETGID", "KILL")
_DNS_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                        r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_CONFIGMAP_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_CONFIGMAP_MAX_BYTES = 1000 * 1000  # the API server's limit is 1 MiB for the whole object


@dataclass(frozen=True)
class Images:
    """The images of a deployment: the sandbox image of each package set (:func:`~rewardbox.images.image.image_key` ->
    image) and the service image (the gateway)."""

    sandbox: Mapping[tuple, str]
    service: str

    def in_registry(self, registry: str) -> "Images":
        """The same images as ``registry`` holds them (what ``rewardbox build --push --registry`` pushed).

        Raises:
            ConfigError: ``registry`` is not ``host[:port][/path]``.
        """
        return Images({k: registry_reference(registry, v) for k, v in self.sandbox.items()},
                      registry_reference(registry, self.service))


@dataclass(frozen=True)
class _Options:
    namespace: Optional[str]
    runtime_class: Optional[str]
    trainer_label: tuple  # (key, value)
    names: dict  # reward name -> Kubernetes name
    client_certificates: bool = False  # gateways require trainers' client certificates (serve --tls-client-ca)


def resource_name(reward_name: str) -> str:
    """The Kubernetes name of a reward's objects: ``rewardbox-`` and the name, lower-case, ``_`` as ``-``."""
    return PREFIX + reward_name.lower().replace("_", "-")


def runtime_class_name(runtime: Optional[str], override: Optional[str] = None) -> Optional[str]:
    """The pod's RuntimeClass for ``sandbox.docker.runtime``: ``override`` when given, else ``gvisor`` for runsc
    and the runtime's own name for others; None without a runtime.

    Raises:
        ConfigError: ``override`` without a runtime (the runtime decides the sandbox's limits), or a name that is
            not a valid RuntimeClass name.
    """
    if not runtime:
        if override:
            raise ConfigError(f"--runtime-class {override}: set sandbox.docker.runtime as well (runsc for gVisor): "
                              "it decides the sandbox's per-sample limits and how its slots are cleaned up")
        return None
    name = override or ("gvisor" if is_gvisor(runtime) else runtime)
    if len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise ConfigError(f"RuntimeClass {name!r} (from sandbox.docker.runtime {runtime!r}) is not a valid "
                          "Kubernetes name: give the cluster's RuntimeClass with --runtime-class NAME")
    return name


def _options(config: RewardboxConfig, namespace: Optional[str], runtime_class: Optional[str],
             trainer_label: str, client_certificates: bool = False) -> _Options:
    """The checked options and names.

    Raises:
        ConfigError: a bad namespace, trainer label or runtime class; a reward name Kubernetes cannot use, or two
            rewards with one Kubernetes name.
    """
    if namespace is not None and (len(namespace) > 63 or not _NAMESPACE.match(namespace)):
        raise ConfigError(f"--namespace {namespace!r}: a namespace is lower-case letters, digits and '-' (at most "
                          "63 characters)")
    key, sep, value = trainer_label.partition("=")
    if not sep or not _LABEL_KEY.match(key) or len(key.rpartition("/")[2]) > 63 or len(value) > 63 \
            or not _LABEL_VALUE.match(value):
        raise ConfigError(f"--trainer-label {trainer_label!r}: expected KEY=VALUE, a Kubernetes label of the "
                          f"trainer pods, e.g. {DEFAULT_TRAINER_LABEL}")
    runtime = docker_settings(config.sandbox).runtime
    names: dict[str, str] = {}
    by_name: dict[str, str] = {}
    for i, reward in enumerate(config.rewards):
        name = resource_name(reward.name)
        if len(name) > 63 or not _DNS_LABEL.match(name) or len(reward.name) > 63 \
                or not _LABEL_VALUE.match(reward.name):
            raise ConfigError(f"{config.where.at('rewards', i, 'name')}: reward {reward.name!r} cannot name "
                              f"Kubernetes objects ({name}): rename it to start and end with a letter or digit, at "
                              f"most {63 - len(PREFIX)} characters")
        if name in by_name:
            raise ConfigError(f"{config.where.at('rewards', i, 'name')}: rewards {by_name[name]!r} and "
                              f"{reward.name!r} both become the Kubernetes name {name} (lower-case, '_' as '-'): "
                              "rename one")
        by_name[name] = reward.name
        names[reward.name] = name
    return _Options(namespace, runtime_class_name(runtime, runtime_class), (key, value), names, client_certificates)


def quantity(size: str, what: str) -> str:
    """A Docker-style size (``64m``, ``1g``, ``1.5g``, bytes) as a Kubernetes quantity (``64Mi``, ``1Gi``,
    ``1536Mi``), exactly.

    Raises:
        ConfigError: ``size`` is not a size, naming ``what`` (the config key).
    """
    return _binary_quantity(_bytes(size, what))


def _bytes(size: str, what: str) -> int:
    try:
        return docker.utils.parse_bytes(size)
    except docker.errors.DockerException:
        raise ConfigError(f"{what}: {size!r} is not a size like 64m or 1g") from None


def _binary_quantity(n: int) -> str:
    for suffix, shift in (("Ti", 40), ("Gi", 30), ("Mi", 20), ("Ki", 10)):
        if n and n % (1 << shift) == 0:
            return f"{n >> shift}{suffix}"
    return str(n)


def _cpu_quantity(cpus: float) -> str:
    return str(int(cpus)) if float(cpus).is_integer() else f"{round(cpus * 1000)}m"


def _security(**fields) -> dict:
    """A container's security context: the given fields, then what every container of ours gets."""
    return {**fields, "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "seccompProfile": {"type": "RuntimeDefault"}}


def per_pod_max_in_flight(reward: RewardSpec) -> Optional[int]:
    """A reward's ``max_in_flight`` split over its pods (each gateway enforces its own share): rounded down, at
    least 1. None when the reward sets none."""
    if reward.max_in_flight is None:
        return None
    return max(1, reward.max_in_flight // reward.replicas)


def gateway_config(config: RewardboxConfig, reward: RewardSpec, filename: str) -> str:
    """The config the gateway of ``reward`` runs (``config.yaml`` of its ConfigMap): this reward only, from
    ``filename`` beside it, one replica, attached to the pod's sandbox server."""
    sandbox = {"backend": "attached", "attached": {"target": f"unix://{SOCKET_DIR_IN_CONTAINER}/{SOCKET_NAME}"}}
    for key in SandboxSettings.model_fields:
        if key != "backend":
            sandbox[key] = getattr(config.sandbox, key)
    entry = reward.model_dump(mode="json", exclude_defaults=True)
    for key in ("name", "source", "packages", "secrets", "env", "replicas", "max_in_flight"):
        entry.pop(key, None)
    entry = {"name": reward.name, "source": filename, **entry, "replicas": 1}
    header = [f"# The gateway of reward {reward.name} (`rewardbox serve` in each pod of {resource_name(reward.name)}), "
              f"from {config.where.file}.",
              "# Its sandbox is the pod's sandbox container, reached at its socket; packages, secrets and env are "
              "that container's."]
    limit = per_pod_max_in_flight(reward)
    if limit is not None:
        entry["max_in_flight"] = limit
        header.append(f"# max_in_flight: the config's {reward.max_in_flight} for the reward as a whole, divided over "
                      f"its {reward.replicas} pod(s), rounded down (at least 1): {limit} per pod.")
    body = yaml.safe_dump({"sandbox": sandbox, "rewards": [entry]}, sort_keys=False)
    return "\n".join(header) + "\n" + body


def _env(reward: RewardSpec) -> list:
    """The sandbox container's environment: each secret from the Secret rewardbox-secrets, then the plain env
    (which wins over a secret of the same name, as in the docker backend)."""
    env = [{"name": s, "valueFrom": {"secretKeyRef": {"name": REWARD_SECRETS, "key": s}}}
           for s in reward.secrets if s not in reward.env]
    return env + [{"name": k, "value": v} for k, v in reward.env.items()]


def _reward_manifests(config: RewardboxConfig, index: int, reward: RewardSpec, images: Images,
                      options: _Options) -> list:
    name = options.names[reward.name]
    labels = {"app.kubernetes.io/name": "rewardbox", "app.kubernetes.io/component": "reward",
              "rewardbox.dev/reward": reward.name}

    def metadata(**extra) -> dict:
        meta = {"name": name}
        if options.namespace:
            meta["namespace"] = options.namespace
        return {**meta, "labels": dict(labels), **extra}

    image = images.sandbox.get(image_key(reward))
    if image is None:
        raise ConfigError(f"reward {reward.name!r}: no sandbox image was given for its packages {reward.packages} "
                          f"and system packages {reward.system_packages}")
    settings = docker_settings(config.sandbox)
    runtime = settings.runtime
    plan = slot_plan(reward, runtime)
    spec = ContainerSpec(image=image, name=name, server_uid=NOBODY, slot_uids=(POD_SLOT_UID_BASE, plan.slots),
                         runtime=runtime, default_warm=plan.default_warm, sample_nproc=plan.sample_nproc,
                         sample_memory=plan.sample_memory, slot_root=SCRATCH)
    tmpfs_bytes = _bytes(settings.tmpfs_size, "sandbox.docker.tmpfs_size")
    path = config.source_path(reward)
    filename = path.name
    where = config.where.at("rewards", index, "source")
    if not _CONFIGMAP_KEY.match(filename):
        raise ConfigError(f"{where}: reward {reward.name!r}: its file name {filename!r} cannot be a ConfigMap key "
                          "(letters, digits, '-', '_' and '.' only): rename the file")
    data = {"config.yaml": gateway_config(config, reward, filename), filename: path.read_text()}
    if sum(len(v.encode()) for v in data.values()) > _CONFIGMAP_MAX_BYTES:
        raise ConfigError(f"{where}: reward {reward.name!r}: {path} is too large for a ConfigMap (1 MB)")
    digest = hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]

    resources = {"cpu": _cpu_quantity(reward.cpus), "memory": quantity(reward.memory, f"reward {reward.name!r}: "
                                                                                       "memory")}
    mounts: list[dict[str, Any]] = [{"name": "socket", "mountPath": SOCKET_DIR_IN_CONTAINER},
                                    {"name": "scratch", "mountPath": SCRATCH}]
    volumes = [
        {"name": "socket", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        # Each slot's scratch directory and its programs' (rewardbox.sandbox.run); like the docker backend's tmpfs
        # per slot, they count against memory.
        {"name": "scratch", "emptyDir": {"medium": "Memory",
                                         "sizeLimit": _binary_quantity(tmpfs_bytes * 2 * plan.slots)}},
    ]
    if reward.isolation != "worker":
        # No shared memory between samples: the pod's /dev/shm (world-writable, shared by its containers) is
        # replaced by an empty read-only one, as the docker backend runs such containers without /dev/shm.
        mounts.append({"name": "no-shm", "mountPath": "/dev/shm", "readOnly": True})
        volumes.append({"name": "no-shm", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}})
    volumes += [
        {"name": "config", "configMap": {"name": name, "defaultMode": SECRET_MODE}},
        {"name": "tls", "secret": {"secretName": TLS_SECRET, "defaultMode": SECRET_MODE}},
    ]
    if options.client_certificates:
        volumes.append({"name": "client-ca", "secret": {"secretName": CLIENT_CA_SECRET, "defaultMode": SECRET_MODE}})
    sandbox = {
        "name": "sandbox",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", "rewardbox.sandbox"],
        "args": spec.server_command(),
        "env": _env(reward),
        "resources": {"limits": dict(resources), "requests": dict(resources)},
        "securityContext": _security(runAsUser=0, runAsGroup=0, runAsNonRoot=False,
                                     capabilities={"drop": ["ALL"], "add": list(DEFAULT_CAPABILITIES)}),
        "volumeMounts": mounts,
        # All containers get SIGTERM at once: the sandbox keeps serving while the gateway drains.
        "lifecycle": {"preStop": {"sleep": {"seconds": int(DRAIN_GRACE_S)}}},
    }
    if not sandbox["env"]:
        del sandbox["env"]
    probe = {"tcpSocket": {"port": PORT}}  # a gRPC probe cannot send the token
    serve_tls = ["--tls-cert", f"{TLS_DIR}/tls.crt", "--tls-key", f"{TLS_DIR}/tls.key"]
    if options.client_certificates:
        serve_tls += ["--tls-client-ca", f"{CLIENT_CA_DIR}/ca.crt"]
    gateway = {
        "name": "gateway",
        "image": images.service,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-m", "rewardbox", "serve", f"{CONFIG_DIR}/config.yaml", "--listen", f"0.0.0.0:{PORT}",
                    *serve_tls],
        "ports": [{"name": "grpc", "containerPort": PORT, "protocol": "TCP"}],
        "env": [{"name": TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": TOKEN_SECRET, "key": "token"}}}],
        "resources": {"limits": dict(GATEWAY_RESOURCES), "requests": dict(GATEWAY_RESOURCES)},
        "securityContext": _security(runAsNonRoot=True, runAsUser=NOBODY, runAsGroup=NOBODY,
                                     capabilities={"drop": ["ALL"]}),
        "volumeMounts": [{"name": "socket", "mountPath": SOCKET_DIR_IN_CONTAINER},
                         {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "tls", "mountPath": TLS_DIR, "readOnly": True},
                         *([{"name": "client-ca", "mountPath": CLIENT_CA_DIR, "readOnly": True}]
                           if options.client_certificates else [])],
        # Start-up loads the reward in the sandbox (sandbox.start_timeout_s) before the port opens.
        "startupProbe": {**probe, "periodSeconds": 5,
                         "failureThreshold": math.ceil(config.sandbox.start_timeout_s / 5) + 6},
        "readinessProbe": {**probe, "periodSeconds": 5},
        "livenessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
    }
    socket_dir = {
        "name": "socket-dir",
        "image": image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python3", "-c", f"import os; os.chmod({SOCKET_DIR_IN_CONTAINER!r}, 0o770)"],
        "securityContext": _security(runAsUser=0, runAsGroup=0, runAsNonRoot=False, capabilities={"drop": ["ALL"]}),
        "volumeMounts": [{"name": "socket", "mountPath": SOCKET_DIR_IN_CONTAINER}],
    }
    pod = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "shareProcessNamespace": False,
        "terminationGracePeriodSeconds": int(DRAIN_GRACE_S) + 15,
        "securityContext": {"fsGroup": NOBODY, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    if options.runtime_class:
        pod["runtimeClassName"] = options.runtime_class
    pod.update(initContainers=[socket_dir], containers=[sandbox, gateway], volumes=volumes)

    trainer_key, trainer_value = options.trainer_label
    return [
        {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": metadata(), "spec": {
            "podSelector": {"matchLabels": dict(labels)},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {trainer_key: trainer_value}}}],
                         "ports": [{"protocol": "TCP", "port": PORT}]}],
            # network: false -> no egress at all; network: true -> any.
            "egress": [{}] if reward.network else [],
        }},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata(), "data": data},
        {"apiVersion": "v1", "kind": "Service", "metadata": metadata(), "spec": {
            "clusterIP": "None",
            "selector": dict(labels),
            "ports": [{"name": "grpc", "port": PORT, "targetPort": "grpc", "protocol": "TCP"}],
        }},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": metadata(), "spec": {
            "replicas": reward.replicas,
            "selector": {"matchLabels": dict(labels)},
            "template": {"metadata": {"labels": dict(labels), "annotations": {"rewardbox.dev/config-sha256": digest}},
                         "spec": pod},
        }},
    ]


def manifests(config: RewardboxConfig, images: Images, namespace: Optional[str] = None,
              runtime_class: Optional[str] = None, trainer_label: str = DEFAULT_TRAINER_LABEL,
              client_certificates: bool = False) -> list[dict]:
    """The Kubernetes objects that serve ``config``'s rewards: per reward a NetworkPolicy, a ConfigMap, a headless
    Service and a Deployment, in that order. Reads the rewards' files; touches no engine or cluster.

    Args:
        images: the images as the cluster pulls them (see :meth:`Images.in_registry`).
        namespace: set on every object when given.
        runtime_class: the pod's RuntimeClass; by default from ``sandbox.docker.runtime`` (gvisor for runsc).
        trainer_label: ``KEY=VALUE``, the label of the pods that may connect.
        client_certificates: the gateways require client certificates signed by the CA in the secret
            :data:`CLIENT_CA_SECRET` (mutual TLS: peers without one never reach HTTP/2).
    Raises:
        ConfigError: a bad option, a reward name or file Kubernetes cannot use, too low ``pids``, or a bad size.
    """
    options = _options(config, namespace, runtime_class, trainer_label, client_certificates)
    docs = []
    for i, reward in enumerate(config.rewards):
        docs += _reward_manifests(config, i, reward, images, options)
    return docs


def endpoints(config: RewardboxConfig, namespace: Optional[str]) -> list[str]:
    """The trainers' ``sandbox.remote.endpoints``: each reward's Service by its DNS name."""
    ns = namespace or "<namespace>"
    return [f"dns:///{resource_name(r.name)}.{ns}.svc:{PORT}" for r in config.rewards]


def trainer_sandbox_section(config: RewardboxConfig, namespace: Optional[str],
                            client_certificates: bool = False) -> dict:
    """The ``sandbox:`` section of a trainer's config that scores on these services."""
    remote = {"endpoints": endpoints(config, namespace), "tls_ca": "ca.crt"}
    if client_certificates:
        remote.update(tls_client_cert="client.crt", tls_client_key="client.key")
    return {"backend": "remote", "remote": {**remote, "token_env": TOKEN_ENV}}


def instructions(config: RewardboxConfig, namespace: Optional[str] = None,
                 trainer_label: str = DEFAULT_TRAINER_LABEL, runtime_class: Optional[str] = None,
                 client_certificates: bool = False) -> str:
    """The manifests' leading comment: what to create first, what the cluster needs, and the trainers' side."""
    ns = f" -n {namespace}" if namespace else ""
    where = namespace or "<namespace>"
    hosts = ", ".join(f"{resource_name(r.name)}.{where}.svc" for r in config.rewards)
    owners: dict[str, list[str]] = {}
    for r in config.rewards:
        for s in r.secrets:
            owners.setdefault(s, []).append(r.name)
    key, _, value = trainer_label.partition("=")
    lines = [
        f"rewardbox deploy kubernetes: the rewards of {config.where.file} as shared services (`rewardbox serve`).",
        "",
        f"Create first{f' in namespace {namespace}' if namespace else ''}:",
        "1. the token trainers send (every gateway checks it):",
        f"     kubectl create secret generic {TOKEN_SECRET}{ns} --from-literal=token=\"$(openssl rand -hex 32)\"",
        f"2. the gateways' TLS certificate (for {hosts}, or *.{where}.svc) and its key:",
        f"     kubectl create secret tls {TLS_SECRET}{ns} --cert=tls.crt --key=tls.key",
    ]
    step = 3
    if client_certificates:
        lines += [f"{step}. the CA that signs the trainers' client certificates (client.crt and client.key, one per "
                  "trainer; the gateways refuse any other peer in the TLS handshake):",
                  f"     kubectl create secret generic {CLIENT_CA_SECRET}{ns} --from-file=ca.crt=client-ca.crt"]
        step += 1
    if owners:
        literals = " ".join(f'--from-literal={s}="${s}"' for s in owners)
        owned = "; ".join(f"{s}: {', '.join(o)}" for s, o in owners.items())
        lines += [f"{step}. the rewards' secrets ({owned}):",
                  f"     kubectl create secret generic {REWARD_SECRETS}{ns} {literals}"]
    lines += [
        "",
        "The cluster needs: a network plugin that enforces NetworkPolicy (without one, `network: false` is NOT",
        "enforced); Pod Security `baseline` or laxer in the namespace (the sandbox container starts as root with",
        "SETUID, SETGID and KILL, as in the docker backend: its supervisor gives each sample a uid of its own)"
        + (f"; the RuntimeClass {runtime_class}." if runtime_class else "."),
        "",
        f"Trainer pods need the label {key}: \"{value}\" and the same namespace; their config's sandbox section",
        "(ca.crt: the CA that signed tls.crt; the token in $" + TOKEN_ENV
        + ("; client.crt and client.key: the trainer's certificate" if client_certificates else "") + "):",
        "",
    ]
    section = yaml.safe_dump({"sandbox": trainer_sandbox_section(config, namespace, client_certificates)},
                             sort_keys=False)
    lines += section.rstrip("\n").splitlines()
    return "".join(f"# {line}".rstrip() + "\n" for line in lines)


class _ManifestDumper(yaml.SafeDumper):
    """SafeDumper that writes multi-line strings (a reward's file, the gateway's config) as literal blocks, and
    repeats shared values instead of writing YAML anchors."""

    def ignore_aliases(self, data) -> bool:
        return True


def _represent_str(dumper: yaml.SafeDumper, data: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if "\n" in data else None)


_ManifestDumper.add_representer(str, _represent_str)

# Comments placed above a line of a Deployment, by (the container it is in, the line without its indentation).
_COMMENTS = {
    ("sandbox", "runAsUser: 0"): [
        "Root, holding only SETUID, SETGID and KILL (runAsNonRoot: false on purpose): the sandbox's supervisor gives",
        "each sample a uid of its own and kills what it leaves; the gRPC server drops to 65534 and samples hold no",
        "capability (as in the docker backend's containers).",
    ],
    ("socket-dir", "- name: socket-dir"): [
        "The socket's emptyDir is world-writable as the kubelet makes it: make it 0770 (root's, group 65534 by",
        "fsGroup) before the sandbox starts, so no sample can replace the socket the gateway connects to. Root",
        "here only as the directory's owner: no capability.",
    ],
}
_CONTAINERS = {"sandbox", "gateway", "socket-dir"}


def _with_comments(text: str) -> str:
    """``text`` with _COMMENTS inserted; unchanged if that would change what it parses to (a block scalar)."""
    out: list[str] = []
    container: Optional[str] = None
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("- name: ") and stripped[len("- name: "):] in _CONTAINERS:
            container = stripped[len("- name: "):]
        comment = _COMMENTS.get((container, stripped)) if container is not None else None
        if comment:
            indent = line[: len(line) - len(line.lstrip())]
            out += [f"{indent}# {c}\n" for c in comment]
        out.append(line)
    annotated = "".join(out)
    return annotated if yaml.safe_load(annotated) == yaml.safe_load(text) else text


def to_yaml(docs: list[dict]) -> str:
    """Multi-document YAML of ``docs`` (keys in their order), Deployments commented."""
    parts = []
    for doc in docs:
        text = yaml.dump(doc, Dumper=_ManifestDumper, sort_keys=False, explicit_start=True)
        parts.append(_with_comments(text) if doc.get("kind") == "Deployment" else text)
    return "".join(parts)


def image_tags(config: RewardboxConfig) -> Images:
    """The local tags of the config's images, as ``rewardbox build`` makes them, without building anything (the
    base image is pulled or made if missing).

    Raises:
        BackendError: no Docker engine answers.
        ImageBuildError: the base image cannot be had.
    """
    from ..backends.docker import engine_client
    from ..images.image import ImageBuilder

    settings = docker_settings(config.sandbox)
    client = engine_client()
    try:
        builder = ImageBuilder(client, settings.cache_dir)
        sandbox = {}
        for reward in config.rewards:
            key = image_key(reward)
            if key not in sandbox:
                sandbox[key] = builder.tag_for(settings.base_image, key[0], settings.pip_args, system_packages=key[1],
                                               system_packages_from=settings.system_packages_from)
        return Images(sandbox, builder.service_tag_for(settings.base_image, settings.pip_args))
    finally:
        client.close()


def render(config: RewardboxConfig, registry: str, namespace: Optional[str] = None,
           runtime_class: Optional[str] = None, trainer_label: str = DEFAULT_TRAINER_LABEL,
           client_certificates: bool = False) -> str:
    """The manifests as ``rewardbox deploy kubernetes`` prints them: instructions as comments, then the YAML, with
    the images as ``rewardbox build --push --registry REGISTRY`` pushed them.

    Raises:
        ConfigError: see :func:`manifests`; a bad registry.
        BackendError, ImageBuildError: see :func:`image_tags`.
    """
    registry_reference(registry, "check")  # a malformed registry fails before the engine is asked
    options = _options(config, namespace, runtime_class, trainer_label, client_certificates)
    images = image_tags(config).in_registry(registry)
    docs = manifests(config, images, namespace, runtime_class, trainer_label, client_certificates)
    return instructions(config, namespace, trainer_label, options.runtime_class, client_certificates) + to_yaml(docs)

"""`rewardbox deploy kubernetes`: the manifests validate against the Kubernetes schemas, and every hardening
property is there (each assertion fails if its property is dropped). No cluster and no engine: the images are given,
and the CLI's image-tag lookup is replaced."""

from __future__ import annotations

import json

import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from rewardbox import ConfigError, load_config, parse_config
from rewardbox.backends.docker import DockerBackend, DockerSettings, slot_plan
from rewardbox.cli import app
from rewardbox.deploy.kubernetes import Images, manifests, render, resource_name, to_yaml
from rewardbox.spec import sandbox_settings_model, yaml_load

KUBERNETES_VERSIONS = ("1.37.0", "1.30.0")
# Sandbox images by (pip packages, system packages).
IMAGES = Images({(("emoji",), ()): "reg.example:5000/rewardbox-sandbox:aaa",
                 ((), ()): "reg.example:5000/rewardbox-sandbox:bbb"},
                "reg.example:5000/rewardbox-service:ccc")
JUDGE = """
import os
def judge_llm(prompt, completion, example):
    return float(bool(os.environ.get("OPENAI_API_KEY")))
"""
LENGTH = "def length(prompt, completion, example):\n    return float(len(completion))\n"


@pytest.fixture
def two_rewards(write_config):
    """judge_llm: network, a secret, env, max_in_flight, 2 replicas, a package; length: every default."""
    def write(docker: dict | None = None, **judge) -> "object":
        path = write_config([
            {"name": "judge_llm", "code": JUDGE, "network": True, "secrets": ["OPENAI_API_KEY"],
             "env": {"MODEL": "judge-1"}, "max_in_flight": 5, "replicas": 2, "packages": ["emoji"], "memory": "2g",
             "cpus": 0.5, **judge},
            {"name": "length", "code": LENGTH},
        ], {"backend": "docker", "start_timeout_s": 90, "docker": {"tmpfs_size": "64m", **(docker or {})}})
        return load_config(path)

    return write


def by_kind(docs: list, kind: str, reward: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == resource_name(reward)]
    return doc


def pod(docs: list, reward: str) -> dict:
    return by_kind(docs, "Deployment", reward)["spec"]["template"]["spec"]


def container(docs: list, reward: str, name: str) -> dict:
    [c] = [c for c in pod(docs, reward)["containers"] if c["name"] == name]
    return c


def arg(args: list, flag: str) -> str:
    return args[args.index(flag) + 1]


def test_every_document_validates_strictly_against_the_kubernetes_schemas(two_rewards):
    docs = manifests(two_rewards(), IMAGES, namespace="rl")
    reparsed = list(yaml.safe_load_all(to_yaml(docs)))  # what kubectl reads
    assert reparsed == docs
    assert sorted((d["kind"], d["metadata"]["name"]) for d in docs) == sorted(
        (kind, name) for kind in ("ConfigMap", "Deployment", "NetworkPolicy", "Service")
        for name in ("rewardbox-judge-llm", "rewardbox-length"))
    for version in KUBERNETES_VERSIONS:
        for doc in reparsed:
            kubernetes_validate.validate(doc, version, strict=True)
    # strict validation is not a no-op: a misspelt field fails
    broken = json.loads(json.dumps(by_kind(docs, "Deployment", "length")))
    broken["spec"]["template"]["spec"]["containers"][0]["securityContxt"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSIONS[0], strict=True)


def test_the_sandbox_container_is_root_with_exactly_three_capabilities_and_nothing_else_writable(two_rewards):
    docs = manifests(two_rewards(), IMAGES)
    for reward in ("judge_llm", "length"):
        sandbox = container(docs, reward, "sandbox")
        assert sandbox["securityContext"] == {
            "runAsUser": 0, "runAsGroup": 0, "runAsNonRoot": False,
            "capabilities": {"drop": ["ALL"], "add": ["SETUID", "SETGID", "KILL"]},
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
            "seccompProfile": {"type": "RuntimeDefault"},
        }
        assert sandbox["command"] == ["python3", "-m", "rewardbox.sandbox"]
        mounts = {m["mountPath"]: m for m in sandbox["volumeMounts"]}
        assert set(mounts) == {"/run/rewardbox", "/scratch", "/dev/shm"}
        assert mounts["/dev/shm"]["readOnly"] is True  # isolation: sample: no shared memory between samples
        # no token and no TLS material in the container that runs reward code
        assert all(e["name"] != "REWARDBOX_TOKEN" for e in sandbox.get("env", []))
        assert "rewardbox-token" not in json.dumps(sandbox) and "rewardbox-tls" not in json.dumps(sandbox)
    text = to_yaml(docs)
    block = text[text.index("- name: sandbox"):]
    comment = block[:block.index("runAsUser: 0")].rstrip().splitlines()[-3:]
    assert all(line.strip().startswith("#") for line in comment) and "runAsNonRoot: false on purpose" in \
        " ".join(comment)


def test_the_sandbox_server_gets_the_docker_backends_slots_and_limits_with_pod_uids(two_rewards, monkeypatch):
    config = two_rewards()
    docs = manifests(config, IMAGES)
    judge = config.rewards[0]
    plan = slot_plan(judge, None)
    args = container(docs, "judge_llm", "sandbox")["args"]
    assert arg(args, "--listen") == "unix:///run/rewardbox/grpc.sock"
    assert arg(args, "--server-uid") == "65534"
    assert arg(args, "--slot-uids") == f"20000-{20000 + plan.slots - 1}"
    assert arg(args, "--run-uids") == f"{20000 + plan.slots}-{20000 + 2 * plan.slots - 1}"
    assert arg(args, "--slot-root") == "/scratch"
    assert "--atomic-kill" in args  # runc: a Linux kernel
    # the same numbers as a docker-backend container of this reward (made, not started: no engine is asked)
    monkeypatch.setenv("OPENAI_API_KEY", "k")
    backend = DockerBackend(DockerSettings(), client=object(), builder=object())
    backend.images = {(("emoji",), ()): "img"}
    sandbox = backend.create(judge, 0)
    try:
        spec = sandbox.spec
        assert spec.slot_uids[1] == plan.slots == 64
        assert arg(args, "--sample-nproc") == str(spec.sample_nproc)
        assert arg(args, "--default-warm") == str(spec.default_warm) == "32"
        assert "--sample-memory" not in args and spec.sample_memory is None
    finally:
        sandbox.stop()
    scratch = {v["name"]: v for v in pod(docs, "judge_llm")["volumes"]}["scratch"]
    # tmpfs_size 64m x 64 slots, and as many directories for their programs
    assert scratch["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}


def test_resources_env_and_secrets_come_from_the_reward(two_rewards):
    docs = manifests(two_rewards(), IMAGES)
    judge = container(docs, "judge_llm", "sandbox")
    assert judge["resources"] == {"limits": {"cpu": "500m", "memory": "2Gi"},
                                  "requests": {"cpu": "500m", "memory": "2Gi"}}
    assert judge["env"] == [
        {"name": "OPENAI_API_KEY",
         "valueFrom": {"secretKeyRef": {"name": "rewardbox-secrets", "key": "OPENAI_API_KEY"}}},
        {"name": "MODEL", "value": "judge-1"},
    ]
    assert judge["image"] == "reg.example:5000/rewardbox-sandbox:aaa"
    length = container(docs, "length", "sandbox")
    assert length["resources"]["limits"] == {"cpu": "1", "memory": "1Gi"}
    assert "env" not in length and length["image"] == "reg.example:5000/rewardbox-sandbox:bbb"
    assert by_kind(docs, "Deployment", "judge_llm")["spec"]["replicas"] == 2
    assert by_kind(docs, "Deployment", "length")["spec"]["replicas"] == 1


def test_the_gateway_runs_serve_as_nobody_with_the_token_and_tls_from_secrets(two_rewards):
    docs = manifests(two_rewards(), IMAGES)
    gateway = container(docs, "judge_llm", "gateway")
    assert gateway["image"] == "reg.example:5000/rewardbox-service:ccc"
    assert gateway["command"] == [
        "python3", "-m", "rewardbox", "serve", "/etc/rewardbox/config/config.yaml", "--listen", "0.0.0.0:50051",
        "--tls-cert", "/etc/rewardbox/tls/tls.crt", "--tls-key", "/etc/rewardbox/tls/tls.key"]
    assert gateway["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 65534, "runAsGroup": 65534, "capabilities": {"drop": ["ALL"]},
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    assert gateway["env"] == [{"name": "REWARDBOX_TOKEN",
                               "valueFrom": {"secretKeyRef": {"name": "rewardbox-token", "key": "token"}}}]
    mounts = {m["mountPath"]: m for m in gateway["volumeMounts"]}
    assert mounts["/etc/rewardbox/tls"]["readOnly"] is True and mounts["/etc/rewardbox/config"]["readOnly"] is True
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert gateway[probe]["tcpSocket"] == {"port": 50051}
    spec = pod(docs, "judge_llm")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["tls"]["secret"] == {"secretName": "rewardbox-tls", "defaultMode": 0o440}
    assert volumes["config"]["configMap"] == {"name": "rewardbox-judge-llm", "defaultMode": 0o440}
    assert volumes["socket"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Mi"}
    assert spec["securityContext"] == {"fsGroup": 65534, "seccompProfile": {"type": "RuntimeDefault"}}
    assert spec["automountServiceAccountToken"] is False
    assert "runtimeClassName" not in spec


def test_with_client_certificates_the_gateway_requires_them_and_the_trainers_section_names_theirs(
        two_rewards, monkeypatch):
    import rewardbox.deploy.kubernetes as k8s

    docs = manifests(two_rewards(), IMAGES, namespace="rl", client_certificates=True)
    for doc in docs:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(doc, version, strict=True)
    gateway = container(docs, "length", "gateway")
    assert gateway["command"][-2:] == ["--tls-client-ca", "/etc/rewardbox/client-ca/ca.crt"]
    assert {"name": "client-ca", "mountPath": "/etc/rewardbox/client-ca", "readOnly": True} in gateway["volumeMounts"]
    volumes = {v["name"]: v for v in pod(docs, "length")["volumes"]}
    assert volumes["client-ca"]["secret"] == {"secretName": "rewardbox-client-ca", "defaultMode": 0o440}
    assert "--tls-client-ca" not in container(manifests(two_rewards(), IMAGES), "length", "gateway")["command"]
    monkeypatch.setattr(k8s, "image_tags", local_tags)
    text = render(two_rewards(), "reg.example:5000", namespace="rl", client_certificates=True)
    comments = text[:text.index("---")]
    assert "kubectl create secret generic rewardbox-client-ca -n rl --from-file=ca.crt=client-ca.crt" in comments
    section = yaml.safe_load("\n".join(line[2:] for line in comments.splitlines()
                                       [comments.splitlines().index("# sandbox:"):]))["sandbox"]
    remote = sandbox_settings_model().model_validate(section).backend_settings("remote")
    assert str(remote.tls_client_cert) == "client.crt" and str(remote.tls_client_key) == "client.key"


def test_the_socket_directory_is_closed_to_samples_before_the_sandbox_starts(two_rewards):
    spec = pod(manifests(two_rewards(), IMAGES), "length")
    [init] = spec["initContainers"]
    assert init["command"] == ["python3", "-c", "import os; os.chmod('/run/rewardbox', 0o770)"]
    assert init["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # root only as the directory's owner
    assert init["securityContext"]["allowPrivilegeEscalation"] is False
    assert init["volumeMounts"] == [{"name": "socket", "mountPath": "/run/rewardbox"}]


def test_network_policy_admits_trainers_only_and_egress_only_for_network_true(two_rewards):
    docs = manifests(two_rewards(), IMAGES, trainer_label="team.example/role=trainer")
    for reward, egress in (("judge_llm", [{}]), ("length", [])):
        policy = by_kind(docs, "NetworkPolicy", reward)["spec"]
        assert policy["podSelector"]["matchLabels"] == by_kind(docs, "Deployment", reward)["spec"]["selector"][
            "matchLabels"]
        assert policy["policyTypes"] == ["Ingress", "Egress"]
        assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": {"team.example/role": "trainer"}}}],
                                      "ports": [{"protocol": "TCP", "port": 50051}]}]
        assert policy["egress"] == egress
    default = by_kind(manifests(two_rewards(), IMAGES), "NetworkPolicy", "length")["spec"]
    assert default["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {"rewardbox.dev/trainer": "true"}}}]


def test_a_headless_service_per_reward_selects_its_pods_and_every_object_is_labelled(two_rewards):
    docs = manifests(two_rewards(), IMAGES, namespace="rl")
    labels = {"app.kubernetes.io/name": "rewardbox", "app.kubernetes.io/component": "reward",
              "rewardbox.dev/reward": "judge_llm"}
    service = by_kind(docs, "Service", "judge_llm")["spec"]
    assert service["clusterIP"] == "None"
    assert service["ports"] == [{"name": "grpc", "port": 50051, "targetPort": "grpc", "protocol": "TCP"}]
    assert service["selector"] == labels
    deployment = by_kind(docs, "Deployment", "judge_llm")
    assert deployment["spec"]["template"]["metadata"]["labels"] == labels
    for doc in docs:
        assert doc["metadata"]["namespace"] == "rl"
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "rewardbox"
    assert all("namespace" not in d["metadata"] for d in manifests(two_rewards(), IMAGES))


def test_the_gateways_config_parses_with_the_attached_backend_and_splits_max_in_flight(two_rewards, tmp_path):
    docs = manifests(two_rewards(), IMAGES)
    data = by_kind(docs, "ConfigMap", "judge_llm")["data"]
    assert set(data) == {"config.yaml", "judge_llm.py"}
    assert data["judge_llm.py"] == JUDGE
    folder = tmp_path / "configmap"
    folder.mkdir()
    for key, value in data.items():
        (folder / key).write_text(value)
    gateway = parse_config(yaml_load(data["config.yaml"]), folder)
    assert gateway.sandbox.backend == "attached"
    assert gateway.sandbox.backend_settings("attached").target == "unix:///run/rewardbox/grpc.sock"
    assert gateway.sandbox.start_timeout_s == 90
    [reward] = gateway.rewards
    assert (reward.name, reward.source.name, reward.replicas, reward.max_in_flight) == \
        ("judge_llm", "judge_llm.py", 1, 2)
    assert reward.network and reward.memory == "2g" and reward.cpus == 0.5
    assert reward.secrets == [] and reward.env == {} and reward.packages == []  # the sandbox container's, not its
    assert "rounded down (at least 1): 2 per pod" in data["config.yaml"]
    one = by_kind(manifests(two_rewards(max_in_flight=1, replicas=3), IMAGES), "ConfigMap", "judge_llm")
    assert yaml_load(one["data"]["config.yaml"])["rewards"][0]["max_in_flight"] == 1
    length = yaml_load(by_kind(docs, "ConfigMap", "length")["data"]["config.yaml"])["rewards"][0]
    assert "max_in_flight" not in length


def test_gvisor_gets_its_runtime_class_and_the_docker_backends_gvisor_limits(two_rewards):
    config = two_rewards({"runtime": "runsc"})
    docs = manifests(config, IMAGES)
    spec = pod(docs, "length")
    assert spec["runtimeClassName"] == "gvisor"
    args = container(docs, "length", "sandbox")["args"]
    plan = slot_plan(config.rewards[1], "runsc")
    assert "--atomic-kill" not in args
    assert arg(args, "--default-warm") == "8"
    assert arg(args, "--sample-memory") == str(plan.sample_memory)
    assert arg(args, "--slot-uids") == f"20000-{20000 + plan.slots - 1}"
    assert pod(manifests(config, IMAGES, runtime_class="gvisor-ptrace"), "length")["runtimeClassName"] == \
        "gvisor-ptrace"
    assert pod(manifests(two_rewards({"runtime": "kata"}), IMAGES), "length")["runtimeClassName"] == "kata"
    with pytest.raises(ConfigError, match="sandbox.docker.runtime"):
        manifests(two_rewards(), IMAGES, runtime_class="gvisor")


def test_names_that_kubernetes_cannot_tell_apart_are_an_error_naming_both(write_config):
    config = load_config(write_config([{"name": "my_reward", "code": LENGTH.replace("length", "my_reward")},
                                       {"name": "my-reward", "code": LENGTH.replace("length", "my_reward"),
                                        "file": "other.py", "function": "my_reward"}]))
    with pytest.raises(ConfigError, match="'my_reward' and 'my-reward' both become the Kubernetes name "
                                          "rewardbox-my-reward"):
        manifests(config, Images({((), ()): "x"}, "y"))
    with pytest.raises(ConfigError, match="--trainer-label"):
        manifests(config, Images({((), ()): "x"}, "y"), trainer_label="no-equals-sign")


def local_tags(config) -> Images:
    """What the engine would say: the images' local tags (IMAGES without the registry)."""
    return Images({k: v.split("/", 1)[1] for k, v in IMAGES.sandbox.items()}, IMAGES.service.split("/", 1)[1])


def test_the_leading_comments_say_what_to_create_and_give_the_trainers_sandbox_section(two_rewards, monkeypatch):
    import rewardbox.deploy.kubernetes as k8s

    monkeypatch.setattr(k8s, "image_tags", local_tags)
    text = render(two_rewards(), "reg.example:5000", namespace="rl")
    assert list(yaml.safe_load_all(text)) == manifests(two_rewards(), IMAGES, namespace="rl")
    comments = text[:text.index("---")]
    assert all(line.startswith("#") for line in comments.splitlines())
    assert "kubectl create secret generic rewardbox-token -n rl" in comments
    assert "kubectl create secret tls rewardbox-tls -n rl --cert=tls.crt --key=tls.key" in comments
    assert 'kubectl create secret generic rewardbox-secrets -n rl --from-literal=OPENAI_API_KEY="$OPENAI_API_KEY"' \
        in comments
    section = yaml.safe_load("\n".join(line[2:] for line in comments.splitlines()
                                       [comments.splitlines().index("# sandbox:"):]))["sandbox"]
    sandbox = sandbox_settings_model().model_validate(section)
    remote = sandbox.backend_settings("remote")
    assert sandbox.backend == "remote"
    assert remote.endpoints == ["dns:///rewardbox-judge-llm.rl.svc:50051", "dns:///rewardbox-length.rl.svc:50051"]
    assert remote.token_env == "REWARDBOX_TOKEN" and str(remote.tls_ca) == "ca.crt"


def test_cli_prints_manifests_that_reference_the_pushed_images(two_rewards, monkeypatch):
    import rewardbox.deploy.kubernetes as k8s

    config = two_rewards()
    monkeypatch.setattr(k8s, "image_tags", local_tags)
    result = CliRunner().invoke(app, ["deploy", "kubernetes", config.where.file, "--registry",
                                      "registry.example.com:5000/team", "--namespace", "rl"])
    assert result.exit_code == 0, result.output
    docs = [d for d in yaml.safe_load_all(result.stdout) if d]
    assert len(docs) == 8
    images = {c["image"] for d in docs if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["containers"]}
    assert images == {"registry.example.com:5000/team/rewardbox-sandbox:aaa",
                      "registry.example.com:5000/team/rewardbox-sandbox:bbb",
                      "registry.example.com:5000/team/rewardbox-service:ccc"}
    for doc in docs:
        kubernetes_validate.validate(doc, KUBERNETES_VERSIONS[0], strict=True)

    bad = CliRunner().invoke(app, ["deploy", "kubernetes", config.where.file, "--registry", "https://registry"])
    assert bad.exit_code == 2 and "--registry 'https://registry'" in bad.output
    gvisor = CliRunner().invoke(app, ["deploy", "kubernetes", config.where.file, "--registry", "r",
                                      "--runtime-class", "gvisor"])
    assert gvisor.exit_code == 2 and "sandbox.docker.runtime" in gvisor.output


def test_sizes_become_exact_kubernetes_quantities_and_a_bad_one_names_its_key(two_rewards):
    from rewardbox.deploy.kubernetes import quantity

    assert [quantity(s, "k") for s in ("64m", "1g", "1.5g", "512k", "1000")] == ["64Mi", "1Gi", "1536Mi", "512Ki",
                                                                               "1000"]
    with pytest.raises(ConfigError, match=r"sandbox.docker.tmpfs_size: '50%' is not a size"):
        manifests(two_rewards({"tmpfs_size": "50%"}), IMAGES)

"""What `rewardbox deploy kubernetes` relies on, with a real engine: the service image builds offline and runs
`rewardbox serve`; `rewardbox build --push` fails clearly when no registry answers (a real push is not tested: no
registry here); and the pod's socket-dir step closes the socket's directory to sample uids."""

from __future__ import annotations

import json
import uuid

import docker.errors
import pytest
from typer.testing import CliRunner

from rewardbox.backends.docker import DockerSettings
from rewardbox.cli import app
from rewardbox.images.image import ImageBuilder
from rewardbox.deploy.kubernetes import Images, manifests
from rewardbox.spec import load_config

pytestmark = pytest.mark.docker

REWARD = "def r(prompt, completion, example):\n    return 1.0\n"
# Binds a Unix socket in the socket directory as each uid (the sandbox server's 65534, a sample's 20000), as root
# holding SETUID and SETGID only; prints the directory's mode and group and what each uid got.
CHECK = """
import json, os, socket, stat

def bind_as(uid):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
        try:
            socket.socket(socket.AF_UNIX).bind(f"/run/rewardbox/{uid}.sock")
            got = "bound"
        except OSError as e:
            got = e.strerror
        os.write(w, got.encode())
        os._exit(0)
    os.waitpid(pid, 0)
    return os.read(r, 200).decode()

info = os.stat("/run/rewardbox")
print(json.dumps({"mode": oct(stat.S_IMODE(info.st_mode)), "gid": info.st_gid, "server": bind_as(65534),
                  "sample": bind_as(20000)}))
"""


@pytest.fixture(scope="module")
def service_image(docker_client, base_image) -> str:
    return ImageBuilder(docker_client).ensure_service(DockerSettings(base_image=base_image))


def test_the_service_image_builds_offline_and_runs_rewardbox_serve(docker_client, service_image):
    assert service_image.startswith("rewardbox-service:")
    # as the gateway container runs it: its command replaces the entrypoint; nobody, read-only, no capabilities
    out = docker_client.containers.run(service_image, ["python3", "-m", "rewardbox", "serve", "--help"],
                                       entrypoint=[], remove=True, network_mode="none", read_only=True,
                                       user="65534:65534", cap_drop=["ALL"])
    text = out.decode()
    assert "--tls-cert" in text and "--listen" in text, text


def test_a_push_to_a_registry_that_does_not_answer_fails_naming_the_registry_and_the_image(
        write_config, docker_client, service_image, base_image, monkeypatch):
    path = write_config([{"name": "r", "code": REWARD}], {"backend": "docker", "docker": {"base_image": base_image}})
    # No sandbox image is built here: the service image (built above) is the one pushed.
    monkeypatch.setattr(ImageBuilder, "ensure_images", lambda self, rewards, settings, force=False: {})
    result = CliRunner().invoke(app, ["build", str(path), "--push", "--registry", "127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert f"pushing 127.0.0.1:1/{service_image} to registry 127.0.0.1:1 failed" in result.output
    assert "Check that a registry answers at 127.0.0.1:1" in result.output
    with pytest.raises(docker.errors.ImageNotFound):  # the name made for the push is removed with it
        docker_client.images.get(f"127.0.0.1:1/{service_image}")


def test_the_pods_socket_dir_step_closes_the_socket_directory_to_samples(write_config, docker_client, base_image):
    config = load_config(write_config([{"name": "r", "code": REWARD}], {"backend": "docker"}))
    [init] = next(d for d in manifests(config, Images({((), ()): base_image}, "unused"))
                  if d["kind"] == "Deployment")["spec"]["template"]["spec"]["initContainers"]

    def fresh_volume():
        # An emptyDir as the kubelet makes it for a pod with fsGroup 65534: world-writable, group 65534, setgid. A
        # tmpfs volume lives while a container has it mounted: a holder keeps it for the steps run one by one.
        options = {"type": "tmpfs", "device": "tmpfs", "o": "size=1m,mode=2777,gid=65534"}
        volume = docker_client.volumes.create(f"rbx-test-{uuid.uuid4().hex[:10]}", driver="local",
                                              labels={"rewardbox": "1"}, driver_opts=options)
        holder = docker_client.containers.run(base_image, ["sleep", "300"], detach=True, network_mode="none",
                                              cap_drop=["ALL"], volumes={volume.name: {"bind": "/v", "mode": "ro"}})
        held.append((holder, volume))
        return volume

    def check(volume) -> dict:
        out = docker_client.containers.run(base_image, ["python3", "-c", CHECK], remove=True, network_mode="none",
                                           user="0:0", cap_drop=["ALL"], cap_add=["SETUID", "SETGID"],
                                           volumes={volume.name: {"bind": "/run/rewardbox", "mode": "rw"}})
        return json.loads(out.decode().strip().splitlines()[-1])

    held = []
    try:
        assert check(fresh_volume())["sample"] == "bound"  # without the step a sample could replace the socket
        security = init["securityContext"]
        assert security["capabilities"] == {"drop": ["ALL"]} and security["runAsUser"] == 0
        volume = fresh_volume()
        docker_client.containers.run(base_image, init["command"], entrypoint=[], remove=True, network_mode="none",
                                     user="0:0", cap_drop=["ALL"], security_opt=["no-new-privileges"],
                                     read_only=True, volumes={volume.name: {"bind": init["volumeMounts"][0][
                                         "mountPath"], "mode": "rw"}})
        assert check(volume) == {"mode": "0o770", "gid": 65534, "server": "bound", "sample": "Permission denied"}
    finally:
        for holder, volume in held:
            holder.remove(force=True)
            volume.remove(force=True)

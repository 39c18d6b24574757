"""system_packages with real images: Debian packages downloaded by the host's apt-get for the offline base image,
installed in the image without a network, cached so that a rebuild reaches no mirror; errors that name the package.
(``system_packages_from: build`` needs an engine whose builds reach a mirror; none does here.)"""

from __future__ import annotations

import io
import time

import docker.errors
import pytest

from rewardbox import ImageBuildError, RewardSandboxes, build_samples, load_config; from rewardbox.images import debs
from rewardbox.images.image import ImageBuilder
from tests.conftest import run
from tests.docker.conftest import docker_backend


def run_in(client, tag: str, command: list[str]) -> str:
    """stdout of ``command`` in a container of ``tag`` as the sandbox runs: no network, read-only root, nobody,
    an executable /tmp for compiled programs."""
    out = client.containers.run(tag, command, entrypoint=[], network_mode="none", read_only=True,
                                user="65534:65534", tmpfs={"/tmp": "rw,exec,size=64m"}, remove=True)
    return out.decode()


def absent(client, tag: str) -> None:
    try:
        client.images.remove(tag, force=True)
    except docker.errors.ImageNotFound:
        pass


def fail(*args, **kwargs):
    raise AssertionError("the deb cache is there: neither apt-get nor the base image may be asked again")


def test_a_system_package_is_downloaded_on_the_host_installed_offline_and_cached(docker_client, base_image,
                                                                                 tmp_path, monkeypatch):
    lines: list[str] = []
    builder = ImageBuilder(docker_client, cache_dir=tmp_path / "cache", on_output=lines.append)
    tag = builder.tag_for(base_image, [], system_packages=["jq"])
    assert tag != builder.tag_for(base_image, [])
    assert tag != builder.tag_for(base_image, [], system_packages=["jq"], system_packages_from="build")
    absent(docker_client, tag)
    try:
        assert builder.ensure(base_image, [], system_packages=["jq"], owners=["r"]) == tag
        assert builder.engine_builds == 1
        assert run_in(docker_client, tag, ["jq", "--version"]).startswith("jq-1.")
        assert run_in(docker_client, tag, ["sh", "-c", "echo '[1, 2, 3]' | jq length"]).strip() == "3"
        assert any(line.startswith("Get:") and "jq" in line for line in lines)  # apt's progress, streamed
        # neither the .deb files nor apt's package lists are left in the image
        leftovers = docker_client.containers.run(tag, ["find", "/", "-xdev", "(", "-name", "*.deb", "-o", "-name",
                                                       "*_Packages*", ")", "-print"], entrypoint=[],
                                                 network_mode="none", user="0", remove=True)
        assert leftovers.decode() == ""

        assert builder.ensure(base_image, [], system_packages=["jq"]) == tag
        assert builder.engine_builds == 1  # hit: no build call at all

        # A forced rebuild takes the cached .deb files: no apt-get, not even a look at the base image's sources.
        monkeypatch.setattr(debs, "run_apt", fail)
        monkeypatch.setattr(debs, "read_base_system", fail)
        assert builder.ensure(base_image, [], system_packages=["jq"], force=True) == tag
        assert builder.engine_builds == 2
        assert run_in(docker_client, tag, ["jq", "--version"]).startswith("jq-1.")
    finally:
        absent(docker_client, tag)


def test_an_unknown_system_package_fails_before_start_naming_it_its_reward_and_the_release(write_config,
                                                                                          docker_client, base_image):
    path = write_config([{"name": "exec_reward", "code": "def exec_reward(prompt, completion, example):\n"
                                                         "    return 1.0\n",
                          "system_packages": ["jq", "rewardbox-no-such-deb-zz9"]}],
                        {"backend": "docker", "docker": {"base_image": base_image}})
    config = load_config(path)
    with pytest.raises(ImageBuildError) as e:
        RewardSandboxes(config, backend=docker_backend(config, docker_client)).start()
    message = str(e.value)
    assert message.startswith("system package 'rewardbox-no-such-deb-zz9' (needed by reward 'exec_reward') does "
                              "not exist in Debian GNU/Linux 12 (bookworm)")
    assert "check the name on packages.debian.org (release bookworm)" in message
    assert message.endswith("apt-get said: E: Unable to locate package rewardbox-no-such-deb-zz9")


def test_a_base_image_without_dpkg_is_named_as_not_debian_based(docker_client, base_image, tmp_path):
    no_dpkg = "rewardbox-test/no-dpkg:1"
    docker_client.images.build(fileobj=io.BytesIO(f"FROM {base_image}\nRUN rm /usr/bin/dpkg\n".encode()),
                               tag=no_dpkg, network_mode="none", rm=True, labels={"rewardbox": "1"})
    try:
        builder = ImageBuilder(docker_client, cache_dir=tmp_path / "cache", on_output=lambda line: None)
        with pytest.raises(ImageBuildError, match=r"base image 'rewardbox-test/no-dpkg:1' cannot take "
                                                  r"system_packages: dpkg does not run in it.*Debian-based"):
            builder.ensure(no_dpkg, [], system_packages=["jq"], owners=["r"])
        assert builder.engine_builds == 0
        leftovers = docker_client.containers.list(all=True, filters={"ancestor": no_dpkg}, ignore_removed=True)
        assert leftovers == []  # the probe container is removed
    finally:
        absent(docker_client, no_dpkg)


def test_a_reward_runs_a_system_package_from_its_own_image(docker_sandboxes):
    code = """
    import subprocess
    def jq_length(prompt, completion, example):
        out = subprocess.run(["jq", "length"], input=completion, capture_output=True, text=True, check=True)
        return float(out.stdout)
    """
    s = docker_sandboxes([{"name": "jq_length", "code": code, "system_packages": ["jq"]},
                          {"name": "plain", "code": "def plain(prompt, completion, example):\n    return 1.0\n"}])
    report = run(s["jq_length"].client.score(build_samples(["p", "p"], ["[1, 2, 3]", '{"a": 1, "b": 2}'], {})))
    assert report.statuses == ["ok", "ok"] and report.values == [3.0, 2.0]
    images = {r.name: s.replicas[r.name][0].sandbox.spec.image for r in s.config.rewards}
    assert images["jq_length"] != images["plain"]  # the package is in that reward's image only


def test_a_compiler_and_a_javascript_runtime_install_offline(docker_client, base_image, tmp_path):
    """g++ and nodejs: what code-execution rewards need (about 85 MB of .deb files for bookworm)."""
    lines: list[str] = []
    builder = ImageBuilder(docker_client, cache_dir=tmp_path / "cache", on_output=lines.append)
    tag = builder.tag_for(base_image, [], system_packages=["g++", "nodejs"])
    absent(docker_client, tag)
    try:
        started = time.monotonic()
        assert builder.ensure(base_image, [], system_packages=["nodejs", "g++"], owners=["exec_reward"]) == tag
        print(f"g++ and nodejs: {next(line for line in lines if line.startswith('system packages '))}; "
              f"download and build {time.monotonic() - started:.1f}s; image "
              f"{docker_client.images.get(tag).attrs['Size'] / 1e6:.0f} MB")
        assert run_in(docker_client, tag, ["g++", "--version"]).startswith("g++ (Debian 12")
        assert run_in(docker_client, tag, ["node", "--version"]).startswith("v")
        program = ('cd /tmp && printf "#include <iostream>\\nint main() { std::cout << 6 * 7 << std::endl; }\\n" '
                   '> a.cpp && g++ -O1 -o a a.cpp && ./a && node -e "console.log(6 * 7)"')
        assert run_in(docker_client, tag, ["sh", "-c", program]).split() == ["42", "42"]
    finally:
        absent(docker_client, tag)


def test_a_mirror_the_host_cannot_reach_fails_naming_the_base_images_sources(docker_client, base_image, tmp_path,
                                                                             monkeypatch):
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # apt-get honours it: nothing answers there
    builder = ImageBuilder(docker_client, cache_dir=tmp_path / "cache", on_output=lambda line: None)
    with pytest.raises(ImageBuildError) as e:
        builder.ensure(base_image, [], system_packages=["jq"], owners=["exec_reward"], force=True)
    message = str(e.value)
    assert message.startswith("system_packages ['jq'] (needed by reward 'exec_reward'): the host's apt-get could "
                              f"not read the package lists of {base_image}'s sources")
    assert "Could not connect to 127.0.0.1:9" in message
    assert builder.engine_builds == 0
    assert list((tmp_path / "cache").glob("debs/*/.complete")) == []  # nothing half-downloaded is kept as done

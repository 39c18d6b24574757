"""Images, recovery, lifecycle and backend choice with real containers."""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import subprocess
import sys

import docker.errors
import pytest

from rewardbox import BackendError, build_samples
from rewardbox.backends import create_backend
from rewardbox.backends.docker import ContainerSpec, DockerBackend, DockerSandbox, remove_leftovers
from rewardbox.images.image import ImageBuilder
from rewardbox.scoring.replica import Replica
from rewardbox.spec import sandbox_settings_model
from tests.conftest import default_sigint, run
from tests.docker.conftest import docker_backend


def test_a_package_from_packages_works_in_docker_while_absent_on_the_host(docker_sandboxes):
    assert importlib.util.find_spec("emoji") is None, "the test needs a package the host does not have"
    code = """
    import emoji
    def has_emoji(prompt, completion, example):
        return float(emoji.emoji_count(completion))
    """
    s = docker_sandboxes([{"name": "has_emoji", "code": code, "packages": ["emoji"]}])
    report = run(s["has_emoji"].client.score(build_samples(["p", "p"], ["no", "yes \U0001F600\U0001F600"], {})))
    assert report.statuses == ["ok", "ok"] and report.values == [0.0, 2.0]


def test_an_unknown_package_fails_before_start_naming_it(write_config, docker_client, base_image):
    from rewardbox import ImageBuildError, RewardSandboxes, load_config

    path = write_config([{"name": "r", "code": "def r(prompt, completion, example):\n    return 1.0\n",
                          "packages": ["rewardbox-no-such-package-zz9"]}],
                        {"backend": "docker", "docker": {"base_image": base_image}})
    config = load_config(path)
    with pytest.raises(ImageBuildError, match=r"package 'rewardbox-no-such-package-zz9' \(needed by reward 'r'\) "
                                               r"does not exist or has no wheel for Python 3\.11"):
        RewardSandboxes(config, backend=docker_backend(config, docker_client)).start()


def test_image_cache_hit_skips_the_engine_build_and_a_change_misses(docker_client, base_image, tmp_path):
    builder = ImageBuilder(docker_client, cache_dir=tmp_path / "cache", on_output=lambda line: None)
    tag = builder.tag_for(base_image, ["emoji==2.16.0"])
    try:
        docker_client.images.remove(tag, force=True)
    except docker.errors.ImageNotFound:
        pass
    assert builder.ensure(base_image, ["emoji==2.16.0"]) == tag
    assert builder.engine_builds == 1
    assert builder.ensure(base_image, ["emoji==2.16.0"]) == tag
    assert builder.engine_builds == 1  # hit: no build call at all
    assert builder.tag_for(base_image, ["emoji==2.15.0"]) != tag  # any change of what goes in is a new tag


def test_killing_the_container_mid_batch_loses_no_sample(docker_sandboxes):
    code = """
    import time
    def slow(prompt, completion, example):
        time.sleep(0.3)
        return float(len(completion))
    """
    s = docker_sandboxes([{"name": "slow", "code": code, "workers": 2, "retries": 3}])
    replica = s.replicas["slow"][0]
    old = replica.sandbox.container.id

    async def main():
        async def kill():
            await asyncio.sleep(0.5)
            await asyncio.to_thread(replica.sandbox.container.kill)
        killer = asyncio.ensure_future(kill())
        report = await s["slow"].client.score(build_samples(["p"] * 10, ["x" * i for i in range(1, 11)], {}))
        await killer
        return report

    report = run(main())
    assert report.statuses == ["ok"] * 10
    assert report.values == [float(i) for i in range(1, 11)]
    assert replica.restarts == 1 and replica.sandbox.container.id != old


def test_completions_larger_in_all_than_the_sandbox_holds_are_scored_in_calls_it_holds(docker_sandboxes):
    """40 completions of 4 MB (160 MB) for a reward with `memory: 256m`: each fits, all in one call did not (the
    server holds a call several times over: its template was killed on every attempt, and all 40 ended unavailable),
    and the server kept what it freed. Now the host sends calls of at most 1/32 of the memory, the server gives large
    freed blocks back, and all score; a completion that alone is over the share gets its own error, naming the
    fix."""
    code = """
    def size(prompt, completion, example):
        return float(len(completion))
    """
    s = docker_sandboxes([{"name": "size", "code": code, "workers": 2, "memory": "256m", "retries": 1}])
    completions = ["a" * 4_000_000] * 40 + ["b" * (20 << 20), "c"]
    for _ in range(2):  # the second batch finds the server as small as the first did
        report = run(s["size"].client.score(build_samples(["p"] * 42, completions, {})))
        assert report.values[:40] == [4e6] * 40 and report.statuses[:40] == ["ok"] * 40, set(report.errors)
        assert (report.values[41], report.statuses[41]) == (1.0, "ok")
        assert report.statuses[40] == "error" and "raise `memory:` of the reward" in report.errors[40]
        assert report.errors[40].startswith(
            "this sample is 20.0 MiB, more than one call to reward 'size' may carry (8.0 MiB"), report.errors[40]
    assert s.replicas["size"][0].restarts == 0


def test_a_container_that_never_becomes_healthy_fails_with_its_logs(docker_client, base_image, tmp_path):
    sandbox = DockerSandbox(docker_client, ContainerSpec(
        image=base_image, command=("python3", "-c", "print('no server here'); raise SystemExit(3)"),
        name="rewardbox-test-broken", labels={"rewardbox": "1"},
    ))
    replica = Replica(sandbox, [], start_timeout_s=10)
    with pytest.raises(BackendError, match=r"(?s)exited during start-up.*no server here"):
        replica.start()
    with pytest.raises(docker.errors.NotFound):
        docker_client.containers.get("rewardbox-test-broken")  # removed after the failed start


def test_leftover_containers_of_a_dead_run_are_removed_at_start(docker_client, base_image, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    container = docker_client.containers.run(
        base_image, ["sleep", "300"], detach=True, name="rewardbox-test-leftover",
        labels={"rewardbox": "1", "rewardbox.run": "old", "rewardbox.host": socket.gethostname(),
                "rewardbox.pid": str(dead.pid)},
    )
    try:
        assert "rewardbox-test-leftover" in remove_leftovers(docker_client)
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(container.id)
    finally:
        try:
            container.remove(force=True)
        except docker.errors.NotFound:
            pass


def test_auto_picks_docker_when_an_engine_answers_and_never_falls_back_to_local(docker_client, monkeypatch, caplog):
    settings = sandbox_settings_model()
    backend = create_backend(settings(backend="auto"))
    assert isinstance(backend, DockerBackend)
    backend.close()
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with caplog.at_level(logging.WARNING, logger="rewardbox"):
        with pytest.raises(BackendError, match=r"(?s)sandbox\.backend is auto and no Docker engine answers.*"
                                               r"scripts/setup\.sh.*`sandbox\.backend: local` to run reward code "
                                               r"WITHOUT isolation"):
            create_backend(settings(backend="auto"))
    assert "WITHOUT ISOLATION" not in caplog.text  # no local backend was made
    with pytest.raises(BackendError, match="no Docker engine answers"):
        create_backend(settings(backend="docker"))


def test_containers_are_removed_on_exit_and_on_errors(docker_sandboxes, docker_client):
    s = docker_sandboxes([{"name": "r", "code": "def r(prompt, completion, example):\n    return 1.0\n",
                           "replicas": 2}])
    ids = [r.sandbox.container.id for r in s.replicas["r"]]
    s.stop()
    for cid in ids:
        with pytest.raises(docker.errors.NotFound):
            docker_client.containers.get(cid)


def _containers_of(docker_client, pid: int) -> list:
    return docker_client.containers.list(all=True, filters={"label": f"rewardbox.pid={pid}"}, ignore_removed=True)


def test_ctrl_c_removes_every_container(write_config, docker_client, base_image, tmp_path):
    import json
    import signal
    import time

    path = write_config([{"name": "slow", "code": "import time\ndef slow(prompt, completion, example):\n"
                                                  "    time.sleep(30)\n    return 1.0\n", "replicas": 2,
                          "timeout_s": 60}],
                        {"backend": "docker", "docker": {"base_image": base_image}})
    samples = tmp_path / "s.jsonl"
    samples.write_text("".join(json.dumps({"prompt": "p", "completion": str(i)}) + "\n" for i in range(4)))
    proc = subprocess.Popen([sys.executable, "-m", "rewardbox", "score", str(path), "--samples", str(samples)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)
    deadline = time.monotonic() + 60
    while len(_containers_of(docker_client, proc.pid)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_containers_of(docker_client, proc.pid)) == 2
    time.sleep(1.0)  # scoring is under way
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode != 0
    assert _containers_of(docker_client, proc.pid) == []


def test_a_reward_that_fails_to_load_leaves_no_container(write_config, docker_client, base_image):
    from rewardbox import RewardLoadError, RewardSandboxes, load_config

    path = write_config([{"name": "ok", "code": "def ok(prompt, completion, example):\n    return 1.0\n"},
                         {"name": "broken", "code": "def broken(prompt, completion, example):\n    return (\n",
                          "replicas": 2}],
                        {"backend": "docker", "docker": {"base_image": base_image}})
    config = load_config(path)
    sandboxes = RewardSandboxes(config, backend=docker_backend(config, docker_client))
    with pytest.raises(RewardLoadError, match=r"broken\.py:2: SyntaxError"):
        sandboxes.start()
    assert _containers_of(docker_client, os.getpid()) == []


def test_a_frozen_container_is_replaced_after_the_deadline_and_no_sample_is_lost(docker_sandboxes):
    code = """
    import time
    def slow(prompt, completion, example):
        time.sleep(0.2)
        return float(len(completion))
    """
    s = docker_sandboxes([{"name": "slow", "code": code, "workers": 2, "timeout_s": 1, "retries": 2}],
                         sandbox={"rpc_grace_s": 1})
    replica = s.replicas["slow"][0]
    old = replica.sandbox.container

    async def main():
        async def freeze():
            await asyncio.sleep(0.3)
            await asyncio.to_thread(old.pause)  # alive but unreachable: no answer, no error
        freezer = asyncio.ensure_future(freeze())
        report = await s["slow"].client.score(build_samples(["p"] * 4, ["a", "bb", "ccc", "dddd"], {}))
        await freezer
        return report

    report = run(main())
    assert report.statuses == ["ok"] * 4 and report.values == [1.0, 2.0, 3.0, 4.0]
    assert replica.restarts == 1 and replica.sandbox.container.id != old.id
    with pytest.raises(docker.errors.NotFound):
        old.reload()  # the frozen one was removed


def test_clean_removes_unused_sandbox_images_and_keeps_those_in_use(docker_sandboxes, docker_client, base_image):
    s = docker_sandboxes([{"name": "r", "code": "def r(prompt, completion, example):\n    return 1.0\n"}])
    in_use = s.replicas["r"][0].sandbox.container.image.tags
    docker_client.images.get(base_image).tag("rewardbox-sandbox", "unused-by-test")
    proc = subprocess.run([sys.executable, "-m", "rewardbox", "clean", "--images"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "rewardbox-sandbox:unused-by-test" in proc.stdout
    with pytest.raises(docker.errors.ImageNotFound):
        docker_client.images.get("rewardbox-sandbox:unused-by-test")
    for tag in in_use:
        docker_client.images.get(tag)  # still there: a container uses it


def _helper_package(root, body: str):
    (root / "rbx_helpers_pkg" / "rbx_helpers").mkdir(parents=True, exist_ok=True)
    (root / "rbx_helpers_pkg" / "pyproject.toml").write_text(
        '[build-system]\nrequires = ["setuptools>=68"]\nbuild-backend = "setuptools.build_meta"\n'
        '[project]\nname = "rbx-helpers"\nversion = "0.1.0"\ndependencies = ["emoji>=2"]\n')
    (root / "rbx_helpers_pkg" / "rbx_helpers" / "__init__.py").write_text(body)


def test_a_local_helper_package_in_packages_is_built_and_installed(docker_sandboxes, docker_client, tmp_path):
    _helper_package(tmp_path, "import emoji\ndef count(text):\n    return float(emoji.emoji_count(text))\n")
    code = """
    from rbx_helpers import count
    def uses_helper(prompt, completion, example):
        return count(completion)
    """
    s = docker_sandboxes([{"name": "uses_helper", "code": code, "packages": ["./rbx_helpers_pkg"]}])
    report = run(s["uses_helper"].client.score(build_samples(["p"], ["two \U0001F600\U0001F600"], {})))
    assert report.statuses == ["ok"] and report.values == [2.0]
    first_tag = s.replicas["uses_helper"][0].sandbox.container.image.tags

    # editing the helper is a new image, not a stale cache hit
    _helper_package(tmp_path, "def count(text):\n    return 7.0\n")
    s2 = docker_sandboxes([{"name": "uses_helper", "code": code, "packages": ["./rbx_helpers_pkg"]}])
    assert run(s2["uses_helper"].client.score(build_samples(["p"], ["x"], {}))).values == [7.0]
    assert s2.replicas["uses_helper"][0].sandbox.container.image.tags != first_tag


def test_a_missing_local_package_is_named_with_its_line(write_config):
    from rewardbox import ConfigError, load_config

    path = write_config([{"name": "r", "code": "def r(prompt, completion, example):\n    return 1.0\n",
                          "packages": ["./not_there"]}])
    with pytest.raises(ConfigError, match=r"rewardbox\.yaml:\d+: reward 'r': local package .*not_there does not exist"):
        load_config(path)


def test_a_config_without_a_base_image_scores_where_no_registry_answers(write_config, docker_client, base_image,
                                                                         caplog):
    from rewardbox import RewardSandboxes, load_config
    from rewardbox.images.base_image import OFFLINE_BASE, BaseImageResolver, slim_image

    code = "def r(prompt, completion, example):\n    return float(len(completion))\n"
    path = write_config([{"name": "r", "code": code}], {"backend": "docker"})  # no docker section: auto
    config = load_config(path)
    registry_problem = BaseImageResolver(docker_client)._registry_problem(slim_image())
    expected = slim_image() if registry_problem is None else OFFLINE_BASE  # here: no registry, the offline base
    with caplog.at_level(logging.INFO, logger="rewardbox"):
        with RewardSandboxes(config, backend=docker_backend(config, docker_client)) as s:
            report = run(s["r"].client.score(build_samples(["p", "p"], ["ab", "abcd"], {})))
            image = s.replicas["r"][0].sandbox.container.image
    assert report.statuses == ["ok", "ok"] and report.values == [2.0, 4.0]
    assert f"sandbox.docker.base_image is auto: using {expected} (" in caplog.text
    if registry_problem is not None:
        assert "no registry answered" in caplog.text
    # the sandbox image was built on the chosen base: it holds that base's layers
    base_layers = docker_client.images.get(expected).attrs["RootFS"]["Layers"]
    assert image.attrs["RootFS"]["Layers"][: len(base_layers)] == base_layers


PRINTS = """
def shout(prompt, completion, example):
    print(f"saw {completion}")
    return float(len(completion))
"""


def test_what_a_reward_prints_comes_back_per_sample_where_it_ran_alone(docker_sandboxes):
    s = docker_sandboxes([{"name": "shout", "code": PRINTS},
                          {"name": "shout_worker", "file": "shout.py", "function": "shout", "isolation": "worker",
                           "workers": 1}])
    completions = [f"c{i}" for i in range(12)] + ["<script>alert(1)</script>"]
    plain = run(s["shout"].client.score(build_samples(["p"] * 13, completions, {})))
    assert plain.sample_logs == [""] * 13 and plain.sample_seconds == [None] * 13  # not asked for
    report = run(s["shout"].client.score(build_samples(["p"] * 13, completions, {}), details=True))
    assert report.sample_logs == [f"saw {c}\n" for c in completions]
    assert all(t is not None and 0 <= t < 5 for t in report.sample_seconds)  # each sample's own time, as its process measured it
    assert sorted(report.logs.splitlines()) == sorted(f"saw {c}" for c in completions)
    # a worker that scores the batch in one request: the output is the batch's only
    together = run(s["shout_worker"].client.score(build_samples(["p"] * 13, completions, {}), details=True))
    assert together.sample_logs == [""] * 13 and together.logs == "".join(f"saw {c}\n" for c in completions)
    assert together.sample_seconds == [None] * 13

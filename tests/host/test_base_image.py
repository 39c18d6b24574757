"""`sandbox.docker.base_image: auto`: which base image serves, and why, with and without a registry."""

from __future__ import annotations

import re
import sys
import threading
import time

import docker.errors
import pytest

from rewardbox.images.base_image import OFFLINE_BASE, BaseImageResolver, choose_base_image, slim_image


def test_the_slim_image_is_the_hosts_python_version():
    assert slim_image() == f"python:{sys.version_info.major}.{sys.version_info.minor}-slim"


@pytest.mark.parametrize("present, registry, image, reason", [
    ({slim_image()}, "unreachable", slim_image(), "the engine has it"),
    (set(), None, slim_image(), "a registry answered; pulling it"),
    ({OFFLINE_BASE}, "no such host", OFFLINE_BASE, "no registry answered for python:.* \\(no such host\\); the "
                                                   "offline Debian base is already built"),
    (set(), "no such host", OFFLINE_BASE, "no such host.*building the offline Debian base from Debian packages"),
])
def test_auto_chooses_a_slim_python_where_it_can_else_the_offline_base(present, registry, image, reason):
    asked = []

    def registry_problem(name):
        asked.append(name)
        return registry

    choice = choose_base_image(lambda name: name in present, registry_problem)
    assert choice.image == image
    assert re.search(reason, choice.reason), choice.reason
    assert asked == ([] if slim_image() in present else [slim_image()])  # no probe when the engine has it


class _Images:
    def get(self, name):
        raise docker.errors.ImageNotFound(name)


class _HangingApi:
    def __init__(self):
        self.released = threading.Event()

    def inspect_distribution(self, name):
        self.released.wait(30)  # a registry behind a firewall that drops packets


class _Engine:
    """An engine with no images whose registry never answers."""

    def __init__(self):
        self.images, self.api = _Images(), _HangingApi()


def test_a_registry_that_never_answers_costs_at_most_the_probe_timeout(caplog):
    engine = _Engine()
    resolver = BaseImageResolver(engine, on_output=lambda line: None, probe_timeout_s=0.3)
    started = time.monotonic()
    with caplog.at_level("INFO", logger="rewardbox"):
        image = resolver.resolve("auto")
    engine.api.released.set()
    assert image == OFFLINE_BASE and time.monotonic() - started < 5
    assert "no answer within 0.3s" in caplog.text
    assert caplog.text.count("sandbox.docker.base_image is auto: using") == 1
    assert resolver.resolve("auto") == OFFLINE_BASE  # decided once per run


def test_a_named_base_image_is_used_as_it_is_without_asking_anyone():
    engine = _Engine()
    assert BaseImageResolver(engine, probe_timeout_s=0.01).resolve("python:3.12-slim") == "python:3.12-slim"

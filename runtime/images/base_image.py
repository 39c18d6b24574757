"""Base images of sandbox images: ``auto``, pulling, and the offline Debian base.

``sandbox.docker.base_image: auto`` (the default) picks, once per run, and says which and why in one log line:

1. ``python:X.Y-slim`` (X.Y: this host's Python, so rewards run on the version they were written for) when the
   engine has it;
2. else that image pulled, when a registry answers within ``PROBE_TIMEOUT_S``;
3. else the offline base ``rewardbox/base:bookworm``: Debian with python3 from Debian packages alone (debootstrap,
   then ``docker import``), built on first use with progress. No registry is needed.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import docker
import docker.errors

from ..errors import ImageBuildError

log = logging.getLogger("rewardbox")

AUTO = "auto"
OFFLINE_BASE_REPO = "rewardbox/base"
OFFLINE_BASE = f"{OFFLINE_BASE_REPO}:bookworm"
# How long `auto` waits for a registry. Without a network the engine usually answers at once (no DNS); a firewall
# that drops packets would otherwise hold every start-up for the engine's own connect timeout.
PROBE_TIMEOUT_S = 15.0


def slim_image() -> str:
    """The official slim Python image of this host's Python version."""
    return f"python:{sys.version_info.major}.{sys.version_info.minor}-slim"


def is_offline_base(image: str) -> bool:
    return image.startswith(OFFLINE_BASE_REPO + ":")


@dataclass(frozen=True)
class BaseImageChoice:
    image: str
    reason: str


def choose_base_image(present: Callable[[str], bool], registry_problem: Callable[[str], Optional[str]]
                      ) -> BaseImageChoice:
    """What ``auto`` means here. ``present(image)``: whether the engine has it; ``registry_problem(image)``: None
    when a registry answers for it, else why not."""
    slim = slim_image()
    if present(slim):
        return BaseImageChoice(slim, "the engine has it")
    problem = registry_problem(slim)
    if problem is None:
        return BaseImageChoice(slim, "a registry answered; pulling it")
    if present(OFFLINE_BASE):
        return BaseImageChoice(OFFLINE_BASE, f"no registry answered for {slim} ({problem}); the offline Debian "
                                             "base is already built")
    return BaseImageChoice(OFFLINE_BASE, f"no registry answered for {slim} ({problem}); building the offline Debian "
                                         "base from Debian packages (once, a few minutes)")


class BaseImageResolver:
    """Resolves ``auto`` (once) and makes sure a base image is in the engine: pulled, or built offline."""

    def __init__(self, client: docker.DockerClient,
                 on_output: Callable[[str], None] = lambda line: log.info("%s", line),
                 probe_timeout_s: float = PROBE_TIMEOUT_S):
        self.client = client
        self.on_output = on_output
        self.probe_timeout_s = probe_timeout_s
        self._auto: Optional[BaseImageChoice] = None

    def resolve(self, base_image: str) -> str:
        """The concrete image ``base_image`` stands for: itself, or what ``auto`` chose."""
        if base_image != AUTO:
            return base_image
        if self._auto is None:
            self._auto = choose_base_image(self._present, self._registry_problem)
            log.info("sandbox.docker.base_image is auto: using %s (%s)", self._auto.image, self._auto.reason)
        return self._auto.image

    def ensure(self, base_image: str) -> str:
        """The id of the (resolved) base image, pulling it or building the offline base when it is not present.

        Raises:
            ImageBuildError: it cannot be pulled (with the offline alternative named), or the offline build failed.
        """
        base_image = self.resolve(base_image)
        try:
            return self.client.images.get(base_image).id
        except docker.errors.ImageNotFound:
            pass
        if is_offline_base(base_image):
            build_offline_base(self.client, tag=base_image, on_output=self.on_output)
            return self.client.images.get(base_image).id
        self.on_output(f"pulling {base_image}")
        try:
            return self.client.images.pull(base_image).id
        except docker.errors.APIError as e:
            raise ImageBuildError(
                f"base image {base_image!r} is not present and cannot be pulled ({e.explanation or e}). Without a "
                f"registry, set `sandbox.docker.base_image: auto` (or {OFFLINE_BASE}): it is built from Debian "
                "packages."
            ) from e

    def _present(self, image: str) -> bool:
        try:
            self.client.images.get(image)
            return True
        except docker.errors.ImageNotFound:
            return False

    def _registry_problem(self, image: str) -> Optional[str]:
        outcome: list = []

        def probe() -> None:
            try:
                self.client.api.inspect_distribution(image)
                outcome.append(None)
            except docker.errors.APIError as e:
                outcome.append(str(e.explanation or e).strip().splitlines()[-1][:200])
            except Exception as e:  # noqa: BLE001 - any failure to ask means no answer
                outcome.append(f"{type(e).__name__}: {e}"[:200])

        # A daemon thread, not an executor: a hung probe must not hold the interpreter's exit.
        thread = threading.Thread(target=probe, name="rewardbox-registry-probe", daemon=True)
        thread.start()
        thread.join(self.probe_timeout_s)
        if not outcome:
            return f"no answer within {self.probe_timeout_s:g}s"
        return outcome[0]


def build_offline_base(client: docker.DockerClient, tag: str = OFFLINE_BASE, suite: str = "bookworm",
                       mirror: str = "http://deb.debian.org/debian",
                       on_output: Callable[[str], None] = lambda line: log.info("%s", line)) -> str:
    """Builds a minimal Debian image with python3 from Debian packages alone (debootstrap, then import).

    Needs root and debootstrap (``apt-get install debootstrap``). Returns the tag.

    Raises:
        ImageBuildError: debootstrap is missing, not root, or it failed (with its last output).
    """
    if shutil.which("debootstrap") is None:
        raise ImageBuildError("debootstrap is not installed: `apt-get install debootstrap` (or run scripts/setup.sh)")
    if os.geteuid() != 0:
        raise ImageBuildError("building the offline base image needs root (debootstrap): run it with sudo")
    with tempfile.TemporaryDirectory(prefix="rbx-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        on_output(f"debootstrap {suite} with python3 from {mirror} (a few minutes, once)")
        proc = subprocess.Popen(["debootstrap", "--variant=minbase", "--include=python3", suite, str(rootfs), mirror],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        lines = []
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            lines.append(line.rstrip())
            if line.startswith(("I: Retrieving", "I: Base system installed", "I: Configuring python3")):
                on_output(line.rstrip())
        if proc.wait() != 0:
            raise ImageBuildError("debootstrap failed:\n" + "\n".join(lines[-15:]))
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            shutil.rmtree(rootfs / junk, ignore_errors=True)
        tarball = Path(tmp) / "rootfs.tar"
        subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tarball), "."], check=True)
        repository, _, version = tag.partition(":")
        on_output(f"importing {tag}")
        client.api.import_image_from_file(str(tarball), repository=repository, tag=version or "latest",
                                          changes=['CMD ["python3"]', "ENV LANG=C.UTF-8"])
    return tag

"""Debian packages of sandbox images (a reward's ``system_packages``), downloaded on the host.

By default (``sandbox.docker.system_packages_from: host``) the **host's** apt-get resolves and downloads them for
the base image itself: its sources, signing keys, architecture and dpkg status are read from the image (one
container that runs ``dpkg --print-architecture`` without a network, then copied out of it), and apt-get runs with
a private configuration pointing at those copies. So the .deb files are exactly what the image lacks, for its
release and architecture; the image build installs them with no network (see the Dockerfile), and they are cached
by base image and package list, so a rebuild never reaches a mirror.

With ``system_packages_from: build`` the build context only names the packages and the image build runs apt-get
itself, with the engine's default network: for engines that reach a mirror on hosts without apt-get.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import posixpath
import re
import shutil
import socket
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal, Sequence

import docker
import docker.errors

from ..errors import ImageBuildError
from ..spec import is_debian_package

log = logging.getLogger("rewardbox")

SystemPackagesFrom = Literal["host", "build"]
HOST: SystemPackagesFrom = "host"
BUILD: SystemPackagesFrom = "build"
# In the build context's debs/ folder (see the Dockerfile): the names the build installs from a mirror itself.
INSTALL_LIST = "apt-install.txt"
# What of the base image apt-get needs here: its apt configuration (sources, keys, pinning) and keyrings.
_IMAGE_APT_TREES = ("/etc/apt", "/usr/share/keyrings")
_STATUS = "/var/lib/dpkg/status"
_PROBE_TIMEOUT_S = 60
_FETCH_FAILED = re.compile(r"^(Err:|W: Failed to fetch|W: Some index files failed to download|E: )")
_UNKNOWN = (
    re.compile(r"Unable to locate package (\S+)"),
    re.compile(r"Package '([^']+)' has no installation candidate"),
    re.compile(r"Version '([^']+)' for '([^']+)' was not found"),
    re.compile(r"Couldn't find any package by (?:glob|regex) '([^']+)'"),
)


@dataclass(frozen=True)
class BaseSystem:
    """The Debian (or Debian-like) system of a base image."""

    architecture: str  # "amd64", as dpkg names it
    release: str  # "Debian GNU/Linux 12 (bookworm)"
    codename: str  # "bookworm", or "" when the image does not say
    distribution: str  # "debian", "ubuntu", ... (os-release ID)

    def package_site(self) -> str:
        return "packages.ubuntu.com" if self.distribution == "ubuntu" else "packages.debian.org"


def debs_key(base_id: str, packages: Sequence[str]) -> str:
    """The cache key of the .deb files of ``packages`` for the base image ``base_id``."""
    return hashlib.sha256(json.dumps([base_id, sorted(packages)]).encode()).hexdigest()[:20]


def prepare_debs(client: docker.DockerClient, base_image: str, base_id: str, packages: Sequence[str],
                 source: SystemPackagesFrom, cache_dir: Path, dest: Path, owners: Sequence[str] = (),
                 on_output: Callable[[str], None] = lambda line: log.info("%s", line)) -> None:
    """Fills ``dest``, the build context's ``debs/`` folder: the .deb files the base image lacks (``host``), or the
    list of names the build installs itself (``build``). Empty without packages: the build then runs no apt.

    Raises:
        ImageBuildError: see :func:`download_debs`.
    """
    dest.mkdir(parents=True, exist_ok=True)
    if not packages:
        return
    _check_names(packages, owners)
    if source == BUILD:
        (dest / INSTALL_LIST).write_text("".join(p + "\n" for p in sorted(packages)))
        return
    if source != HOST:
        raise ValueError(f"system_packages_from must be {HOST!r} or {BUILD!r}, not {source!r}")
    for deb in sorted(download_debs(client, base_image, base_id, packages, cache_dir, owners, on_output)
                      .glob("*.deb")):
        shutil.copyfile(deb, dest / deb.name)


def download_debs(client: docker.DockerClient, base_image: str, base_id: str, packages: Sequence[str],
                  cache_dir: Path, owners: Sequence[str] = (),
                  on_output: Callable[[str], None] = lambda line: log.info("%s", line)) -> Path:
    """The folder of the .deb files that installing ``packages`` in image ``base_image`` (id ``base_id``) needs,
    downloaded with the host's apt-get once and cached under ``cache_dir/debs``; a cache hit reaches neither the
    engine nor a mirror.

    Raises:
        ImageBuildError: the host has no apt-get; the base image is not Debian-based; its mirrors cannot be reached;
            a package is unknown to its release (named, with the rewards that need it).
    """
    cached = cache_dir / "debs" / debs_key(base_id, packages)
    if (cached / ".complete").exists():
        on_output(f"system packages {', '.join(sorted(packages))}: cached in {cached}")
        return cached
    apt_get = shutil.which("apt-get")
    if apt_get is None:
        raise ImageBuildError(
            f"system_packages {sorted(packages)}{_needed_by(owners)}: system packages are downloaded with the "
            "host's apt-get, and this host has none. On a host without it set `sandbox.docker.system_packages_from: "
            "build`, with a Docker engine whose builds can reach a Debian mirror.")
    with tempfile.TemporaryDirectory(prefix="rbx-apt-") as tmp:
        work = Path(tmp)
        # apt downloads as the unprivileged _apt user where it runs as root: it must reach this folder.
        work.chmod(0o755)
        image_root = work / "image"
        system = read_base_system(client, base_image, image_root)
        env = {**os.environ, "APT_CONFIG": str(_private_config(work)), "LC_ALL": "C", "DEBIAN_FRONTEND":
               "noninteractive"}
        apt = [apt_get, *apt_options(work, image_root, system.architecture)]
        on_output(f"apt-get update with the sources of {base_image} ({system.release}, {system.architecture})")
        code, lines = run_apt([*apt, "update"], env, on_output)
        failed = [line for line in lines if _FETCH_FAILED.match(line)]
        if code != 0 or failed:
            raise ImageBuildError(
                f"system_packages {sorted(packages)}{_needed_by(owners)}: the host's apt-get could not read the "
                f"package lists of {base_image}'s sources ({system.release}); the host must reach the mirrors "
                f"named in the image's /etc/apt (or set `sandbox.docker.system_packages_from: build`). apt-get "
                "said:\n" + "\n".join((failed or lines)[-8:]))
        on_output(f"downloading system packages for {base_image}: {', '.join(sorted(packages))}")
        code, lines = run_apt([*apt, "install", "--download-only", "--no-install-recommends", "-y",
                               *sorted(packages)], env, on_output)
        if code != 0:
            raise ImageBuildError(_explain_apt_failure(lines, packages, owners, system))
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix="debs-", dir=cached.parent))
        try:
            debs = sorted((work / "archives").glob("*.deb"))
            for deb in debs:
                shutil.move(str(deb), staging / deb.name)
            (staging / ".complete").touch()
            shutil.rmtree(cached, ignore_errors=True)
            staging.rename(cached)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    size = sum(f.stat().st_size for f in cached.glob("*.deb"))
    on_output(f"system packages {', '.join(sorted(packages))}: {len(debs)} .deb files, {size / 1e6:.1f} MB, "
              f"cached in {cached}")
    return cached


def run_apt(cmd: Sequence[str], env: dict, on_output: Callable[[str], None]) -> tuple[int, list[str]]:
    """Runs apt-get, streaming each line of its output to ``on_output``. Returns (exit code, the lines).
    apt's own per-connection timeouts (``Acquire::*::Timeout``) bound its waits on a mirror."""
    lines = []
    with subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          env=env, text=True) as proc:
        assert proc.stdout is not None  # stdout=PIPE
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                lines.append(line)
                on_output(line)
    return proc.returncode, lines


def apt_options(work: Path, image_root: Path, architecture: str) -> list[str]:
    """apt-get options that make the host's apt-get act for the image copied to ``image_root``: its sources, keys,
    pinning and dpkg status, its architecture only; lists, caches and downloads (``work/archives``) in ``work``."""
    etc = image_root / "etc" / "apt"
    settings = {
        "Dir::Etc": etc,
        "Dir::Etc::SourceList": etc / "sources.list",
        "Dir::Etc::SourceParts": etc / "sources.list.d",
        "Dir::Etc::Trusted": etc / "trusted.gpg",
        "Dir::Etc::TrustedParts": etc / "trusted.gpg.d",
        "Dir::Etc::Preferences": etc / "preferences",
        "Dir::Etc::PreferencesParts": etc / "preferences.d",
        "Dir::State": work / "state",
        "Dir::State::Lists": work / "state" / "lists",
        "Dir::State::status": image_root / _STATUS.lstrip("/"),
        "Dir::State::extended_states": work / "state" / "extended_states",
        "Dir::Cache": work / "cache",
        "Dir::Cache::archives": work / "archives",
        "Dir::Log": work / "log",
        "APT::Architecture": architecture,
        "APT::Architectures": architecture,
        "Acquire::Languages": "none",
        "Debug::NoLocking": "1",
    }
    for folder in (work / "state" / "lists" / "partial", work / "cache", work / "archives" / "partial",
                   work / "log"):
        folder.mkdir(parents=True, exist_ok=True)
    return [arg for key, value in settings.items() for arg in ("-o", f"{key}={value}")]


def _private_config(work: Path) -> Path:
    """An APT_CONFIG file: the host's own settings (proxies, mirror credentials) without its hooks, which would
    act on the host (package-manager notifications), and without its configuration folders being read again."""
    try:
        out = subprocess.run(["apt-config", "shell", "PARTS", "Dir::Etc::parts/d", "MAIN", "Dir::Etc::main/f"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    found = dict(re.findall(r"^(PARTS|MAIN)='(.*)'$", out, re.M))
    lines = ["// rewardbox: the host's apt settings, less its hooks; the image's sources come from the options"]
    if found.get("PARTS") and Path(found["PARTS"]).is_dir():
        lines.append(f'#include "{found["PARTS"].rstrip("/")}/";')
    if found.get("MAIN") and Path(found["MAIN"]).is_file():
        lines.append(f'#include "{found["MAIN"]}";')
    for hooks in ("APT::Update::Pre-Invoke", "APT::Update::Post-Invoke", "APT::Update::Post-Invoke-Success",
                  "DPkg::Pre-Invoke", "DPkg::Post-Invoke", "DPkg::Pre-Install-Pkgs", "APT::Architectures"):
        lines.append(f"#clear {hooks};")
    empty = work / "conf.d"
    empty.mkdir()
    lines += [f'Dir::Etc::parts "{empty}";', f'Dir::Etc::main "{empty}/none";']
    path = work / "apt.conf"
    path.write_text("\n".join(lines) + "\n")
    return path


def read_base_system(client: docker.DockerClient, base_image: str, root: Path) -> BaseSystem:
    """Copies what apt-get needs of ``base_image`` to ``root`` (its apt configuration and keyrings, any key its
    sources name, its dpkg status) and returns its architecture and release. The image runs only
    ``dpkg --print-architecture``, without a network.

    Raises:
        ImageBuildError: the image has no dpkg or apt (not Debian-based), or the engine failed.
    """
    try:
        # Labelled like the backends' containers: `rewardbox clean` removes it if this process dies first.
        labels = {"rewardbox": "1", "rewardbox.host": socket.gethostname(), "rewardbox.pid": str(os.getpid())}
        container = client.containers.create(base_image, ["dpkg", "--print-architecture"], entrypoint=[],
                                             network_mode="none", labels=labels)
    except docker.errors.APIError as e:
        raise ImageBuildError(f"cannot read base image {base_image!r} for its system packages: "
                              f"{e.explanation or e}") from e
    try:
        try:
            container.start()
            code = container.wait(timeout=_PROBE_TIMEOUT_S)["StatusCode"]
            architecture = container.logs(stdout=True, stderr=False).decode(errors="replace").strip()
        except docker.errors.APIError as e:
            raise ImageBuildError(_not_debian(base_image, f"dpkg does not run in it: {e.explanation or e}")) from e
        except OSError as e:  # the engine's answer timed out (requests' errors are OSErrors)
            raise ImageBuildError(f"base image {base_image!r}: `dpkg --print-architecture` did not finish within "
                                  f"{_PROBE_TIMEOUT_S}s ({e})") from e
        if code != 0 or not re.fullmatch(r"[a-z0-9-]+", architecture):
            raise ImageBuildError(_not_debian(base_image, f"`dpkg --print-architecture` failed ({architecture!r})"))
        for path in (*_IMAGE_APT_TREES, _STATUS):
            if not _copy_out(container, path, root) and path != "/usr/share/keyrings":
                raise ImageBuildError(_not_debian(base_image, f"it has no {path}"))
        for path in _signed_by_paths(root):
            if not (root / path.lstrip("/")).exists():
                _copy_out(container, path, root)
        _point_signed_by_at_copies(root)
        release = _os_release(container)
    finally:
        try:
            container.remove(force=True)
        except docker.errors.APIError:
            log.warning("could not remove the probe container %s of %s", container.short_id, base_image)
    return BaseSystem(architecture=architecture,
                      release=release.get("PRETTY_NAME") or release.get("VERSION_CODENAME") or base_image,
                      codename=release.get("VERSION_CODENAME", ""), distribution=release.get("ID", "debian"))


def _not_debian(base_image: str, why: str) -> str:
    return (f"base image {base_image!r} cannot take system_packages: {why}. They need a Debian-based image with dpkg "
            "and apt (python:3.X-slim, the offline rewardbox/base:bookworm, debian:*, ubuntu:*); set "
            "`sandbox.docker.base_image` to one, or drop `system_packages`.")


def _copy_out(container, path: str, root: Path) -> bool:
    """Copies ``path`` (a file or folder) out of the container to the same place under ``root``; False when the
    image has no such path."""
    try:
        stream, _ = container.get_archive(path)
        archive = b"".join(stream)
    except docker.errors.NotFound:
        return False
    _extract(archive, posixpath.dirname(path.rstrip("/")), root)
    return True


def _extract(archive: bytes, parent: str, root: Path) -> None:
    """Writes the files, folders and links of a ``get_archive`` tarball of something in image folder ``parent``
    under ``root`` (the image's ``/`` here). Nothing lands outside ``root``: names are checked, and a link is kept
    only when it points inside ``root`` (an absolute one is made relative to it)."""
    root = root.resolve()
    root.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            name = posixpath.normpath(posixpath.join(parent.lstrip("/"), member.name))
            if name.startswith(("/", "..")) or name == ".":
                continue
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if not target.parent.resolve().is_relative_to(root):
                continue
            if member.isdir():
                target.mkdir(exist_ok=True)
            elif member.isfile():
                data = tar.extractfile(member)
                target.unlink(missing_ok=True)
                target.write_bytes(data.read() if data else b"")
            elif member.issym():
                link = member.linkname
                pointee = posixpath.normpath(link.lstrip("/") if link.startswith("/")
                                             else posixpath.join(posixpath.dirname(name), link))
                if pointee.startswith("..") or not (root / pointee).resolve().is_relative_to(root):
                    continue
                target.unlink(missing_ok=True)
                target.symlink_to(os.path.relpath(root / pointee, target.parent))


_SIGNED_BY = re.compile(r"(?im)(^Signed-By:[ \t]*|signed-by=)(/[^\s\]]+)")


def _sources_files(root: Path) -> list[Path]:
    etc = root / "etc" / "apt"
    return [p for p in [etc / "sources.list", *sorted((etc / "sources.list.d").glob("*"))]
            if p.is_file() and p.suffix in (".list", ".sources")]


def _signed_by_paths(root: Path) -> list[str]:
    """The key files the image's sources name (``Signed-By:``, ``[signed-by=...]``)."""
    return sorted({m[2] for p in _sources_files(root) for m in _SIGNED_BY.finditer(p.read_text(errors="replace"))})


def _point_signed_by_at_copies(root: Path) -> None:
    """Makes the image's sources name the copies of their keys under ``root``, not the host's files."""
    for p in _sources_files(root):
        text = p.read_text(errors="replace")
        p.write_text(_SIGNED_BY.sub(lambda m: m[1] + str(root / m[2].lstrip("/")), text))


def _os_release(container) -> dict:
    """The image's os-release fields (empty when it has none); links (/etc/os-release usually is one) followed."""
    path = "/etc/os-release"
    for _ in range(5):
        try:
            stream, _ = container.get_archive(path)
            archive = b"".join(stream)
        except docker.errors.NotFound:
            return {}
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            member = tar.next()
            if member is None:
                return {}
            if member.issym():
                path = posixpath.normpath(posixpath.join(posixpath.dirname(path), member.linkname))
                continue
            data = tar.extractfile(member)
            text = data.read().decode(errors="replace") if data else ""
        return {k: v.strip().strip('"') for k, v in re.findall(r"^([A-Z_]+)=(.*)$", text, re.M)}
    return {}


def _check_names(packages: Sequence[str], owners: Sequence[str]) -> None:
    bad = [p for p in packages if not is_debian_package(p)]
    if bad:
        raise ImageBuildError(f"system package {bad[0]!r}{_needed_by(owners)} is not a Debian package name "
                              "(lower-case letters, digits and + - ., optionally =VERSION)")


def _needed_by(owners: Sequence[str]) -> str:
    return f" (needed by reward {', '.join(repr(o) for o in owners)})" if owners else ""


def _explain_apt_failure(lines: Sequence[str], packages: Sequence[str], owners: Sequence[str],
                         system: BaseSystem) -> str:
    text = "\n".join(lines)
    errors = [line for line in lines if line.startswith("E: ")]
    for pattern in _UNKNOWN:
        m = pattern.search(text)
        if m:
            name = f"{m[2]}={m[1]}" if m.re is _UNKNOWN[2] else m[1]
            release = system.codename or system.release
            return (f"system package {name!r}{_needed_by(owners)} does not exist in {system.release} for "
                    f"{system.architecture}, in the base image's sources: check the name on "
                    f"{system.package_site()} (release {release}), and the version if you pinned one.\n"
                    f"apt-get said: {errors[-1] if errors else lines[-1]}")
    tail = "\n".join((errors or list(lines))[-8:])
    return (f"downloading system packages {sorted(packages)}{_needed_by(owners)} for {system.release} "
            f"({system.architecture}) failed:\n{tail}")

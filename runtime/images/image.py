"""Sandbox images: one per distinct package set, tagged by a content hash of everything that goes in.

The user's packages (and the server's own) are resolved and downloaded **on the host** into a wheelhouse for the
base image's Python version and platform, then installed in the image with ``pip --no-index``: the build needs no
network, so it works where containers cannot reach a package index, and with private indexes (``pip_args``).
A reward's Debian packages (``system_packages``) are downloaded on the host the same way, by the host's apt-get for
the base image's release and architecture (:mod:`.debs`), and installed in the image without a network.
A second build with nothing changed finds the tag and never calls the engine's build.

The image gets the sandbox side of rewardbox only: ``rewardbox.sandbox`` and ``rewardbox.wire``, copied from
wherever this package is installed (a checkout or a wheel), under a ``rewardbox/__init__.py`` of its own.

The service image (``rewardbox-service``: ``rewardbox serve``, the gateway container of a Kubernetes pod) is built
the same way, offline from a wheelhouse, with the whole of rewardbox but the trainer and rewardbox's own runtime
dependencies. :meth:`ImageBuilder.push` sends either kind to a registry.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from importlib import metadata
from importlib.util import find_spec
from pathlib import Path
from typing import Callable, Literal, Optional, Protocol, Sequence

import docker
import docker.errors
from packaging.requirements import Requirement
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import ConfigError, ImageBuildError, ImagePushError
from ..spec import RewardSpec, is_local_package
from ..wire import VERSION
from .base_image import BaseImageResolver
from .debs import BUILD, HOST, SystemPackagesFrom, prepare_debs



class BuildSettings(Protocol):
    """What the builder reads of the docker backend's settings (``rewardbox.backends.docker.DockerSettings``): the
    backend uses the builder, so the builder does not import the backend."""

    base_image: str
    pip_args: list
    system_packages_from: Literal["host", "build"]

log = logging.getLogger("rewardbox")

IMAGE_REPO = "rewardbox-sandbox"
SERVER_DISTRIBUTIONS = ("grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf")
# What of rewardbox goes into the image: the sandbox and the wire module, found (not imported) where installed.
IMAGE_PACKAGES = ("rewardbox.sandbox", "rewardbox.wire")
# The image's rewardbox/__init__.py: the host's own would name host modules the image does not have.
IMAGE_INIT = (f'"""rewardbox {VERSION}, sandbox side: rewardbox.sandbox and rewardbox.wire."""\n\n'
              f'__version__ = "{VERSION}"\n')
SERVICE_REPO = "rewardbox-service"
# What goes into the service image: every package of rewardbox but the trainer (it needs the train extra), each
# package's own files (a wheel nests the subpackages inside rewardbox/, a checkout maps them from other folders).
SERVICE_PACKAGES = ("rewardbox", "rewardbox.sandbox", "rewardbox.wire")  # each with its subpackages
SERVICE_DOCKERFILE = "Dockerfile.service"
# A registry as `rewardbox build --push --registry` takes it: host[:port], then path components (no scheme, no tag).
_REGISTRY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?(:[0-9]+)?(/[a-z0-9]+([._-][a-z0-9]+)*)*$")
# Push progress lines that repeat per layer and per chunk; the others (pushed, exists, digest) are shown.
_PUSH_NOISE = {"Preparing", "Waiting", "Pushing"}
_STEP = re.compile(r"^Step (\d+)/(\d+) : (.*)")
_PROBE = (
    "import json, platform, sys; "
    "print(json.dumps({'python': '%d.%d' % sys.version_info[:2], 'machine': platform.machine(), "
    "'libc': list(platform.libc_ver())}))"
)


def default_cache_dir() -> Path:
    return Path(os.environ.get("REWARDBOX_CACHE", Path.home() / ".cache" / "rewardbox"))


def server_requirements() -> list[str]:
    """The sandbox server's own dependencies, pinned to the host's versions (the stubs were generated with them)."""
    return [f"{name}=={metadata.version(name)}" for name in SERVER_DISTRIBUTIONS]


@dataclass(frozen=True)
class ImageTarget:
    """What wheels a base image can install."""

    python: str  # "3.11"
    machine: str  # "x86_64"
    libc: tuple  # ("glibc", "2.36") or ("", "") for musl and others

    def pip_platform_args(self) -> list[str]:
        abi = "cp" + self.python.replace(".", "")
        args = ["--python-version", self.python, "--implementation", "cp", "--abi", abi, "--abi", "abi3",
                "--abi", "none"]
        platforms = []
        if self.libc and self.libc[0] == "glibc":
            minor = int(self.libc[1].split(".")[1])
            platforms += [f"manylinux_2_{m}_{self.machine}" for m in range(minor, 4, -1)]
            platforms += [f"manylinux2014_{self.machine}", f"manylinux2010_{self.machine}",
                          f"manylinux1_{self.machine}"]
        else:
            platforms += [f"musllinux_1_{m}_{self.machine}" for m in range(2, -1, -1)]
        platforms.append(f"linux_{self.machine}")
        for p in platforms:
            args += ["--platform", p]
        return args

    def describe(self) -> str:
        libc = "-".join(self.libc) if self.libc and self.libc[0] else "non-glibc"
        return f"Python {self.python} on {self.machine} ({libc})"


_NOT_CONTENT = {"__pycache__", ".git", "build", "dist", ".venv", ".mypy_cache", ".pytest_cache"}


def _tree_digest(path: Path) -> str:
    """sha256 over a folder's files (names and bytes), or a file's bytes."""
    h = hashlib.sha256()
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*")
        if p.is_file() and not _NOT_CONTENT.intersection(p.relative_to(path).parts)
        and not any(part.endswith(".egg-info") for part in p.relative_to(path).parts)
    )
    for f in files:
        h.update(str(f.relative_to(path) if f != path else f.name).encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def _content_keys(packages: Sequence[str]) -> list[str]:
    """What identifies each package's content: a local folder by a digest of its files, so an edit rebuilds."""
    return [f"{p}@sha256:{_tree_digest(Path(p).expanduser())}" if is_local_package(p) else p for p in packages]


def package_dir(name: str) -> Path:
    """The folder of an installed package of ours, without importing it."""
    spec = find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ImageBuildError(f"{name} is not installed with rewardbox; reinstall rewardbox")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


SERVICE_EXTRAS = ("openrlhf",)  # extras of rewardbox serve's own options (--openrlhf), where the host has them


def service_requirements() -> list[str]:
    """``rewardbox serve``'s dependencies: rewardbox's own (``[project].dependencies``) and those of
    :data:`SERVICE_EXTRAS` that the host has installed, pinned to the host's versions.

    Raises:
        ImageBuildError: rewardbox is not installed as a distribution (its requirements are unknown).
    """
    try:
        required = metadata.requires("rewardbox") or []
    except metadata.PackageNotFoundError:
        raise ImageBuildError("rewardbox is not installed as a distribution, so the service image's dependencies "
                              "are unknown: install it (`pip install -e .` in a checkout)") from None
    names = []
    for r in map(Requirement, required):
        if r.marker is None or (any(r.marker.evaluate({"extra": e}) for e in SERVICE_EXTRAS) and _installed(r.name)):
            names.append(r.name)
    return [f"{name}=={metadata.version(name)}" for name in dict.fromkeys(names)]


def _installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def dockerfile() -> Path:
    return package_dir("rewardbox.sandbox") / "Dockerfile"


def service_dockerfile() -> Path:
    return package_dir("rewardbox") / SERVICE_DOCKERFILE


def image_files() -> dict[str, Path]:
    """What of rewardbox goes into the image, by its path under the image's ``rewardbox/`` folder: the modules and
    stubs of IMAGE_PACKAGES (not the Dockerfile, not the dev-only stub generator)."""
    files = {}
    for name in IMAGE_PACKAGES:
        root = package_dir(name)
        sub = name.split(".", 1)[1]
        for path in sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix in (".py", ".pyi") \
                    and path.name != "protogen.py":
                files[f"{sub}/{path.relative_to(root).as_posix()}"] = path
    return files


def service_files() -> dict[str, Path]:
    """What of rewardbox goes into the service image, by its path under the image's ``rewardbox/`` folder: the
    modules, stubs and ``py.typed`` of SERVICE_PACKAGES (with the package's own ``__init__.py`` and ``__main__.py``,
    so ``python3 -m rewardbox serve`` works there), with their subpackages."""
    files = {}
    for name in SERVICE_PACKAGES:
        root = package_dir(name)
        prefix = "".join(f"{part}/" for part in name.split(".")[1:])
        for path in sorted(root.rglob("*")):
            inner = path.relative_to(root).parts
            if name == "rewardbox" and inner[0] in ("trainer", "sandbox", "wire"):
                continue  # installed from a wheel, rewardbox/ holds them too: no trainer; the others come whole below
            if path.is_file() and (path.suffix in (".py", ".pyi") or path.name == "py.typed") \
                    and path.name != "protogen.py" and "__pycache__" not in path.parts:
                files[f"{prefix}{path.relative_to(root).as_posix()}"] = path
    return files


@dataclass(frozen=True)
class _Recipe:
    """What one kind of image is made of."""

    repo: str
    dockerfile: Path
    files: dict  # path under the image's rewardbox/ -> the file here
    init: Optional[str]  # the image's own rewardbox/__init__.py; None: the package's own, among ``files``
    requirements: list  # the pinned distributions its code needs


def _sandbox_recipe() -> _Recipe:
    return _Recipe(IMAGE_REPO, dockerfile(), image_files(), IMAGE_INIT, server_requirements())


def _service_recipe() -> _Recipe:
    return _Recipe(SERVICE_REPO, service_dockerfile(), service_files(), None, service_requirements())


def image_key(reward: RewardSpec) -> tuple:
    """What a reward's sandbox image is keyed by: (sorted pip packages, sorted system packages)."""
    return tuple(sorted(reward.packages)), tuple(sorted(reward.system_packages))


def content_hash(base_id: str, target: ImageTarget, requirements: Sequence[str], pip_args: Sequence[str],
                 recipe: Optional[_Recipe] = None, system_packages: Sequence[str] = (),
                 system_packages_from: SystemPackagesFrom = HOST) -> str:
    """sha256 over the base image id, its target, the requirements, pip arguments, system packages and where they
    come from, Dockerfile and code of an image (by default a sandbox image)."""
    recipe = recipe or _sandbox_recipe()
    h = hashlib.sha256()
    what = {"base": base_id, "target": asdict(target), "requirements": sorted(requirements),
            "pip_args": list(pip_args)}
    if system_packages:  # absent otherwise: an image without them keeps its tag
        what.update(system_packages=sorted(system_packages), system_packages_from=system_packages_from)
    h.update(json.dumps(what, sort_keys=True).encode())
    if recipe.init is not None:
        h.update(recipe.init.encode())
    h.update(recipe.dockerfile.read_bytes())
    for relative, path in recipe.files.items():
        h.update(relative.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def registry_reference(registry: str, tag: str) -> str:
    """Where image ``tag`` (``rewardbox-sandbox:<hash>``) goes in ``registry`` (``host[:port][/path]``): the name
    ``rewardbox build --push`` pushes and ``rewardbox deploy`` references.

    Raises:
        ConfigError: ``registry`` is not ``host[:port][/path]``.
    """
    registry = registry.rstrip("/")
    if not _REGISTRY.match(registry):
        raise ConfigError(f"--registry {registry!r}: expected a registry host, optionally with :PORT and /PATH, "
                          "without a scheme or a tag, e.g. registry.example.com:5000/team (the path lower-case)")
    return f"{registry}/{tag}"


class ImageBuilder:
    """Builds and caches sandbox images. ``on_output`` receives build progress lines as they stream."""

    def __init__(self, client: docker.DockerClient, cache_dir: Optional[Path] = None,
                 on_output: Callable[[str], None] = lambda line: log.info("%s", line),
                 base_images: Optional[BaseImageResolver] = None):
        self.client = client
        self.cache_dir = Path(cache_dir or default_cache_dir())
        self.on_output = on_output
        self.base_images = base_images or BaseImageResolver(client, on_output=on_output)
        self.engine_builds = 0  # how many times the engine's build was called (cache hits do not count)

    # -- base image ---------------------------------------------------------------------------------------------
    def base_image_id(self, base_image: str) -> str:
        """The id of a concrete base image (not ``auto``), pulling it, or building the offline base, when it is not
        present.

        Raises:
            ImageBuildError: it cannot be pulled (with the offline alternative named).
        """
        return self.base_images.ensure(base_image)

    def target(self, base_image: str, base_id: Optional[str] = None) -> ImageTarget:
        """Python version and platform of a base image; asked once per image id and cached on disk."""
        base_id = base_id or self.base_image_id(base_image)
        cache = self.cache_dir / "targets.json"
        known = json.loads(cache.read_text()) if cache.exists() else {}
        if base_id not in known:
            try:
                out = self.client.containers.run(base_image, ["python3", "-c", _PROBE], remove=True,
                                                 network_mode="none", entrypoint=[])
            except docker.errors.ContainerError as e:
                raise ImageBuildError(f"base image {base_image!r} has no working python3: {e.stderr!r}") from e
            known[base_id] = json.loads(out.decode().strip().splitlines()[-1])
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(known, indent=1))
        t = known[base_id]
        return ImageTarget(python=t["python"], machine=t["machine"], libc=tuple(t["libc"]))

    # -- sandbox image ------------------------------------------------------------------------------------------
    def tag_for(self, base_image: str, packages: Sequence[str], pip_args: Sequence[str] = (), *,
                system_packages: Sequence[str] = (), system_packages_from: SystemPackagesFrom = HOST) -> str:
        """The tag of the sandbox image with these packages on ``base_image`` (may be ``auto``), without building
        it."""
        return self._identity(self.base_images.resolve(base_image), packages, pip_args,
                              system_packages=system_packages, system_packages_from=system_packages_from)[0]

    def _identity(self, base_image: str, packages: Sequence[str], pip_args: Sequence[str],
                  recipe: Optional[_Recipe] = None, system_packages: Sequence[str] = (),
                  system_packages_from: SystemPackagesFrom = HOST) -> tuple:
        """(tag, target) for a concrete base image: it is looked up once for both."""
        recipe = recipe or _sandbox_recipe()
        base_id = self.base_image_id(base_image)
        target = self.target(base_image, base_id)
        digest = content_hash(base_id, target, [*recipe.requirements, *_content_keys(packages)], pip_args, recipe,
                              system_packages, system_packages_from)
        return f"{recipe.repo}:{digest[:20]}", target

    def ensure_images(self, rewards: Sequence[RewardSpec], settings: BuildSettings,
                      force: bool = False) -> dict[tuple, tuple[str, list[str]]]:
        """One image per distinct package set of the rewards: {:func:`image_key`: (tag, names of the rewards)}.

        Raises:
            ImageBuildError: naming the package and the rewards that need it.
        """
        owners: dict[tuple, list[str]] = {}
        for r in rewards:
            owners.setdefault(image_key(r), []).append(r.name)
        base_image = self.base_images.resolve(settings.base_image)
        return {
            key: (self.ensure(base_image, key[0], settings.pip_args, names, force=force, system_packages=key[1],
                              system_packages_from=settings.system_packages_from), names)
            for key, names in owners.items()
        }

    def ensure(self, base_image: str, packages: Sequence[str], pip_args: Sequence[str] = (),
               owners: Sequence[str] = (), force: bool = False, *, system_packages: Sequence[str] = (),
               system_packages_from: SystemPackagesFrom = HOST) -> str:
        """Returns the tag of an image with these pip and Debian packages, building it only when no such image
        exists. ``base_image`` may be ``auto``.

        Raises:
            ImageBuildError: a package cannot be resolved for the image (named, with the rewards that need it).
        """
        return self._ensure(_sandbox_recipe(), self.base_images.resolve(base_image), packages, pip_args, owners,
                            force, system_packages, system_packages_from)

    # -- service image ------------------------------------------------------------------------------------------
    def service_tag_for(self, base_image: str, pip_args: Sequence[str] = ()) -> str:
        """The tag of the service image on ``base_image`` (may be ``auto``), without building it."""
        return self._identity(self.base_images.resolve(base_image), (), pip_args, _service_recipe())[0]

    def ensure_service(self, settings: BuildSettings, force: bool = False) -> str:
        """Returns the tag of the service image (``rewardbox serve``) on the sandbox images' base image, building it
        only when no such image exists.

        Raises:
            ImageBuildError: a dependency has no wheel for the base image's Python (named).
        """
        return self._ensure(_service_recipe(), self.base_images.resolve(settings.base_image), (), settings.pip_args,
                            (), force)

    def _ensure(self, recipe: _Recipe, base_image: str, packages: Sequence[str], pip_args: Sequence[str],
                owners: Sequence[str], force: bool, system_packages: Sequence[str] = (),
                system_packages_from: SystemPackagesFrom = HOST) -> str:
        tag, target = self._identity(base_image, packages, pip_args, recipe, system_packages, system_packages_from)
        if not force:
            try:
                self.client.images.get(tag)
                return tag
            except docker.errors.ImageNotFound:
                pass
        with tempfile.TemporaryDirectory(prefix="rbx-build-") as ctx:
            context = Path(ctx)
            self._wheelhouse(target, list(packages), list(pip_args), context / "wheels", owners, recipe.requirements)
            prepare_debs(self.client, base_image, self.base_image_id(base_image), system_packages,
                         system_packages_from, self.cache_dir, context / "debs", owners, self.on_output)
            package = context / "server" / "rewardbox"
            package.mkdir(parents=True)
            if recipe.init is not None:
                (package / "__init__.py").write_text(recipe.init)
            for relative, path in recipe.files.items():
                (package / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, package / relative)
            shutil.copy(recipe.dockerfile, context / "Dockerfile")
            # Only a build that installs system packages from a mirror itself gets a network.
            self._build(context, tag, base_image, network=bool(system_packages) and system_packages_from == BUILD)
        return tag

    # -- registry -----------------------------------------------------------------------------------------------
    def push(self, tag: str, registry: str) -> str:
        """Tags image ``tag`` as ``registry/tag`` and pushes it with the engine (its credentials: `docker login`),
        streaming progress to ``on_output``. Returns the pushed reference.

        Raises:
            ConfigError: ``registry`` is not ``host[:port][/path]``.
            ImagePushError: ``tag`` does not exist, or the registry refused it or did not answer (both named).
        """
        reference = registry_reference(registry, tag)
        repository, _, version = reference.rpartition(":")
        try:
            self.client.images.get(tag).tag(repository, version)
        except docker.errors.ImageNotFound:
            raise ImagePushError(f"image {tag} does not exist here: build it first (`rewardbox build CONFIG`)") \
                from None
        except docker.errors.APIError as e:
            raise ImagePushError(f"cannot tag {tag} as {reference}: {e.explanation or e}") from e
        self.on_output(f"pushing {reference}")
        try:
            for chunk in self.client.api.push(repository, tag=version, stream=True, decode=True):
                if "error" in chunk:
                    raise ImagePushError(_push_failure(reference, registry, chunk["error"]))
                status = chunk.get("status")
                if status and status not in _PUSH_NOISE:
                    self.on_output(f"{chunk['id']}: {status}" if chunk.get("id") else status)
        except docker.errors.APIError as e:
            self._untag(reference)
            raise ImagePushError(_push_failure(reference, registry, e.explanation or str(e))) from e
        except ImagePushError:
            self._untag(reference)  # the alias was made for this push only
            raise
        return reference

    def _untag(self, reference: str) -> None:
        try:
            self.client.images.remove(reference, noprune=True)
        except docker.errors.APIError:
            pass

    def _wheelhouse(self, target: ImageTarget, packages: list[str], pip_args: list[str], dest: Path,
                    owners: Sequence[str], requirements: Optional[Sequence[str]] = None) -> None:
        base = server_requirements() if requirements is None else list(requirements)
        remote = [*base, *(p for p in packages if not is_local_package(p))]
        local = [p for p in packages if is_local_package(p)]
        key_material = [asdict(target), sorted(remote), sorted(_content_keys(local)), pip_args]
        key = hashlib.sha256(json.dumps(key_material).encode()).hexdigest()[:20]
        cached = self.cache_dir / "wheelhouse" / key
        if not (cached / ".complete").exists():
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix="wheels-", dir=self.cache_dir))
            try:
                built = [self._local_wheel(p, staging, owners) for p in local]
                self.on_output(f"downloading wheels for {target.describe()}: {', '.join(remote + local)} and pip")
                cmd = [sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "--quiet",
                       "--only-binary=:all:", "--dest", str(staging), *target.pip_platform_args(), *pip_args,
                       *remote, *map(str, built), "pip"]
                proc = subprocess.run(cmd, capture_output=True, text=True)
                if proc.returncode != 0:
                    raise ImageBuildError(_explain_pip_failure(proc.stderr, packages, owners, target))
                # Local packages are installed by their distribution names, found among the wheels.
                names = [w.name.split("-")[0] for w in built]
                (staging / "requirements.txt").write_text("".join(r + "\n" for r in [*remote, *names]))
                (staging / ".complete").touch()
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            shutil.rmtree(cached, ignore_errors=True)
            cached.parent.mkdir(parents=True, exist_ok=True)
            staging.rename(cached)
        shutil.copytree(cached, dest, ignore=shutil.ignore_patterns(".complete"))

    def _local_wheel(self, package: str, staging: Path, owners: Sequence[str]) -> Path:
        """A wheel of a local folder (built on the host, without its dependencies) or the local wheel itself.

        Raises:
            ImageBuildError: the folder is not a Python project pip can build (with pip's last lines).
        """
        path = Path(package).expanduser()
        if path.is_file() and path.suffix == ".whl":
            return Path(shutil.copy(path, staging))
        before = set(staging.glob("*.whl"))
        self.on_output(f"building a wheel of {path}")
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "--quiet",
                               "--no-deps", "--wheel-dir", str(staging), str(path)], capture_output=True, text=True)
        new = sorted(set(staging.glob("*.whl")) - before)
        if proc.returncode != 0 or not new:
            tail = "\n".join(proc.stderr.strip().splitlines()[-8:])
            who = f" (needed by reward {', '.join(repr(o) for o in owners)})" if owners else ""
            raise ImageBuildError(f"local package {path}{who} could not be built into a wheel; it needs a "
                                  f"pyproject.toml or setup.py. pip said:\n{tail}")
        return new[0]

    def _build(self, context: Path, tag: str, base_image: str, network: bool = False) -> None:
        self.engine_builds += 1
        self.on_output(f"building {tag} from {base_image}" + (" (with the engine's default network)" if network
                                                              else ""))
        stream = self.client.api.build(path=str(context), tag=tag, buildargs={"BASE": base_image}, rm=True,
                                       forcerm=True, decode=True, network_mode=None if network else "none",
                                       labels={"rewardbox": "1"})
        # A progress bar on a terminal; every line also goes to on_output (the log), terminal or not.
        with Progress(TextColumn(f"[bold]{tag}"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.description}"), TimeElapsedColumn(), console=Console(stderr=True),
                      transient=True, disable=not sys.stderr.isatty()) as progress:
            task = progress.add_task("starting", total=None)
            for chunk in stream:
                if "error" in chunk:
                    raise ImageBuildError(f"building {tag} failed: {chunk['error'].strip()}")
                line = chunk.get("stream", "").rstrip()
                if not line:
                    continue
                step = _STEP.match(line)
                if step:
                    progress.update(task, completed=int(step[1]) - 1, total=int(step[2]), description=step[3][:60])
                self.on_output(line)


def _push_failure(reference: str, registry: str, detail: str) -> str:
    host = registry.split("/", 1)[0]
    return (f"pushing {reference} to registry {registry} failed: {detail.strip()}. Check that a registry answers at "
            f"{host} (and `docker login {host}` where it needs credentials); the Docker engine pushes, so a plain "
            f"HTTP registry must be among its insecure-registries.")


def _explain_pip_failure(stderr: str, packages: Sequence[str], owners: Sequence[str], target: ImageTarget) -> str:
    missing = re.findall(r"No matching distribution found for (\S+)", stderr)
    for_rewards = f" (needed by reward {', '.join(repr(o) for o in owners)})" if owners else ""
    if missing:
        name = missing[0]
        return (f"package {name!r}{for_rewards} does not exist or has no wheel for {target.describe()}. Check the "
                f"name and version in `packages`, or pick a version that ships a wheel for this platform; a "
                f"private index goes in `sandbox.pip_args` (e.g. ['--index-url', URL]).\npip said: "
                f"{stderr.strip().splitlines()[-1]}")
    tail = "\n".join(stderr.strip().splitlines()[-8:])
    return f"resolving packages {list(packages)}{for_rewards} for {target.describe()} failed:\n{tail}"

"""The backend registry: backends by name, each with its own typed settings section.

Built-in backends (``docker``, ``local``) and those of other packages (the ``rewardbox.backends`` entry-point
group, each entry naming a :class:`BackendType`) are imported on first use; :func:`register_backend` adds one at
run time. A config's ``sandbox.backend`` names one, and ``sandbox.<name>:`` holds its settings::

    sandbox:
      backend: docker
      docker: {base_image: auto, runtime: runsc}

``backend: auto`` is docker when an engine answers; otherwise it is an error that says how to start one, or how to
choose ``local`` (no isolation) explicitly. It never falls back to running reward code unisolated.
"""

from __future__ import annotations

import importlib
import logging
import re
import threading
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Callable, Protocol

from pydantic import BaseModel

from .errors import BackendError, ConfigError


class ConfiguredSandbox(Protocol):
    """What :func:`create_backend` reads of a config's ``sandbox:`` section (``rewardbox.spec.SandboxSettings``):
    the registry is below the config model and the backends, and imports neither."""

    backend: str

    def backend_settings(self, name: str) -> BaseModel: ...

log = logging.getLogger("rewardbox")

ENTRY_POINT_GROUP = "rewardbox.backends"
AUTO = "auto"
_BUILTIN = {"docker": "rewardbox.backends.docker:BACKEND", "local": "rewardbox.backends.local:BACKEND",
            "remote": "rewardbox.backends.remote:BACKEND", "attached": "rewardbox.backends.attached:BACKEND"}
_NAME = re.compile(r"^[a-z][a-z0-9_]*$")
# Keys of the sandbox section itself: no backend may take one of these names for its section.
_RESERVED = {AUTO, "backend", "start_timeout_s", "rpc_grace_s", "backoff_initial_s", "backoff_max_s"}


@dataclass(frozen=True)
class BackendType:
    """A backend as registered.

    Attributes:
        name: what ``sandbox.backend`` says, and the key of its settings section.
        settings_type: the pydantic model of ``sandbox.<name>:`` (every field with a default).
        create: makes the backend from its settings.
        isolated: whether reward code is kept from the trainer's rights, files and network.
        summary: one line for ``rewardbox backends`` and error messages.
    """

    name: str
    settings_type: type[BaseModel]
    create: Callable[[Any], Any]  # settings section -> a rewardbox.backends.base.Backend
    isolated: bool
    summary: str = ""


_lock = threading.RLock()  # a backend module may register others while it is imported
_loaded: dict[str, BackendType] = {}
_pending: dict[str, str] = dict(_BUILTIN)  # name -> "module:attr", imported on first use
_entry_points_read = False


def _check(backend: BackendType, origin: str) -> None:
    """Validates a registration, naming where it came from (pluggy-style: at registration, not at first use)."""
    if not isinstance(backend, BackendType):
        raise BackendError(f"{origin}: expected a rewardbox.backends.BackendType, got {type(backend).__name__}")
    if not _NAME.match(backend.name) or backend.name in _RESERVED:
        raise BackendError(f"{origin}: backend name {backend.name!r} must be lower-case letters, digits and _, "
                           f"and not one of {', '.join(sorted(_RESERVED))}")
    if not (isinstance(backend.settings_type, type) and issubclass(backend.settings_type, BaseModel)):
        raise BackendError(f"{origin}: backend {backend.name!r}: settings_type must be a pydantic model class")
    try:
        backend.settings_type()
    except Exception as e:  # noqa: BLE001 - reported with the backend's name
        raise BackendError(f"{origin}: backend {backend.name!r}: every setting of {backend.settings_type.__name__} "
                           f"needs a default ({e})") from None
    if not callable(backend.create):
        raise BackendError(f"{origin}: backend {backend.name!r}: create must be callable")


def register_backend(backend: BackendType, *, replace: bool = False) -> None:
    """Adds a backend under ``backend.name``.

    Raises:
        BackendError: the registration is malformed, or the name is taken and ``replace`` is false.
    """
    _check(backend, f"register_backend({backend.name if isinstance(backend, BackendType) else backend!r})")
    with _lock:
        if not replace and (backend.name in _loaded or backend.name in _pending):
            raise BackendError(f"a backend named {backend.name!r} is already registered; pass replace=True to "
                               "replace it")
        _pending.pop(backend.name, None)
        _loaded[backend.name] = backend


def _read_entry_points() -> None:
    global _entry_points_read
    if _entry_points_read:
        return
    _entry_points_read = True
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in _BUILTIN:
            continue  # our own distribution's entries duplicate the built-ins
        _pending.setdefault(ep.name, ep.value)


def backend_names() -> list[str]:
    """The registered backends' names, sorted (their modules are not imported)."""
    with _lock:
        _read_entry_points()
        return sorted({*_loaded, *_pending})


def backend_type(name: str) -> BackendType:
    """The registered backend ``name``, importing its module on first use.

    Raises:
        ConfigError: no backend has that name (the registered ones are listed).
        BackendError: its module or object cannot be loaded (the entry point is named).
    """
    with _lock:
        _read_entry_points()
        if name in _loaded:
            return _loaded[name]
        target = _pending.get(name)
        if target is None:
            raise ConfigError(f"no backend named {name!r}; registered: {', '.join(sorted({*_loaded, *_pending}))}")
        module, _, attr = target.partition(":")
        try:
            backend = getattr(importlib.import_module(module), attr)
        except Exception as e:  # noqa: BLE001 - a broken plugin is reported with its entry point
            raise BackendError(f"backend {name!r} ({target}) cannot be loaded: {type(e).__name__}: {e}") from e
        _check(backend, f"backend {name!r} ({target})")
        if backend.name != name:
            raise BackendError(f"backend {name!r} ({target}) names itself {backend.name!r}")
        del _pending[name]
        _loaded[name] = backend
        return backend


def backend_types() -> list[BackendType]:
    """Every registered backend, loaded, in name order."""
    return [backend_type(name) for name in backend_names()]


def create_backend(settings: ConfiguredSandbox) -> Any:
    """The backend ``settings.backend`` names, made from its settings section.

    Raises:
        BackendError: ``auto`` with no Docker engine answering (saying how to start one or choose ``local``), or
            the backend could not be made (engine missing, ...).
    """
    name = settings.backend
    if name != AUTO:
        return backend_type(name).create(settings.backend_settings(name))
    try:
        return backend_type("docker").create(settings.backend_settings("docker"))
    except BackendError as e:
        raise BackendError(
            f"sandbox.backend is auto and no Docker engine answers, so there is nothing to isolate reward code "
            f"with ({e}). Start an engine (`bash scripts/setup.sh`, or `sudo dockerd &`), or set "
            "`sandbox.backend: local` to run reward code WITHOUT isolation, as this user (trusted code only)."
        ) from e

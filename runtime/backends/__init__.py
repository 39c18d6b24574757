"""Sandbox backends: ``local`` (subprocess, no isolation) and ``docker`` (hardened containers)."""

from __future__ import annotations

import logging

from ..errors import BackendError
from ..spec import SandboxSettings
from .base import Backend, Sandbox
from .local import LocalBackend, LocalSandbox

log = logging.getLogger("rewardbox")

NOT_ISOLATED_WARNING = (
    "rewardbox: the LOCAL backend runs reward code WITHOUT ISOLATION, as this user, with this machine's network "
    "and files. Use it for trusted code only; install Docker for sandboxing."
)


def docker_available() -> bool:
    """Whether a Docker engine answers a ping."""
    try:
        from .docker import engine_client

        engine_client(timeout=5).ping()
        return True
    except Exception:  # noqa: BLE001 - any failure means "not available"
        return False


def select_backend(settings: SandboxSettings) -> Backend:
    """The backend the settings ask for; ``auto`` picks docker when an engine answers, else local (with a warning).

    Raises:
        BackendError: docker was asked for and no engine answers.
    """
    choice = settings.backend
    if choice == "auto":
        choice = "docker" if docker_available() else "local"
        if choice == "local":
            log.warning("sandbox.backend is auto and no Docker engine answers; falling back to local.")
    if choice == "docker":
        from .docker import DockerBackend

        return DockerBackend()
    if choice == "local":
        log.warning(NOT_ISOLATED_WARNING)
        return LocalBackend()
    raise BackendError(f"unknown backend {choice!r}")


__all__ = ["Backend", "Sandbox", "LocalBackend", "LocalSandbox", "select_backend", "docker_available",
           "NOT_ISOLATED_WARNING"]

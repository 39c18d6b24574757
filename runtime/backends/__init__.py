"""Where sandboxes run. Backends are registered by name, each with its own settings section
(``sandbox.<name>:``): ``docker`` (hardened containers), ``local`` (a subprocess, no isolation), ``remote`` (a
shared ``rewardbox serve``), ``attached`` (sandboxes started elsewhere) and ``ray`` (actors on a Ray cluster) are
built in (``base.py`` is the seam they implement; ``containers.py`` holds what docker and ray share); another package
adds one through the ``rewardbox.backends`` entry-point group, or code calls :func:`register_backend`. A new backend
implements :class:`Backend` and :class:`Sandbox` and passes the conformance suite in ``tests/backends``.
"""

from ..registry import (
    AUTO,
    ENTRY_POINT_GROUP,
    BackendType,
    backend_names,
    backend_type,
    backend_types,
    create_backend,
    register_backend,
)
from .base import Backend, BackendSettings, ExternalSandbox, Sandbox, reward_environment

__all__ = [
    "AUTO",
    "ENTRY_POINT_GROUP",
    "Backend",
    "BackendSettings",
    "BackendType",
    "ExternalSandbox",
    "Sandbox",
    "backend_names",
    "backend_type",
    "backend_types",
    "create_backend",
    "register_backend",
    "reward_environment",
]

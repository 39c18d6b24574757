"""Fakes for the backend seam, handed in through constructors (no patching)."""

from __future__ import annotations

from runtime import BackendError
from runtime.backends.local import LocalBackend, LocalSandbox


class UnrestartableSandbox(LocalSandbox):
    """A real local sandbox whose restarts fail, like an engine that went away."""

    restart_calls = 0

    def restart(self) -> None:
        type(self).restart_calls += 1
        raise BackendError("engine gone")


class UnrestartableBackend(LocalBackend):
    def create(self, reward, replica, settings) -> UnrestartableSandbox:
        sandbox = super().create(reward, replica, settings)
        return UnrestartableSandbox(sandbox.name, sandbox._env)

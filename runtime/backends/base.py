"""The backend seam: a Backend makes Sandboxes; a Sandbox is one running sandbox server with an Endpoint.

Lifecycle calls are synchronous (subprocess and docker-py are); the async scoring path wraps them once, in
:class:`rewardbox.scoring.replica.Replica`, with ``asyncio.to_thread``.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Protocol, Sequence, runtime_checkable

from pydantic import BaseModel, ConfigDict

from ..errors import BackendError

if TYPE_CHECKING:
    from ..spec import RewardSpec
    from ..scoring.transport import Endpoint


class BackendSettings(BaseModel):
    """Base of a backend's settings section (``sandbox.<backend name>:`` in the config): unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def reward_environment(reward: "RewardSpec") -> dict[str, str]:
    """The environment a reward's sandboxes get: exactly its named host secrets, plus its plain ``env``.

    Raises:
        BackendError: a named secret is not set on the host.
    """
    environment = {}
    for secret in reward.secrets:
        if secret not in os.environ:
            raise BackendError(f"reward {reward.name!r}: secret {secret!r} is not set in the environment; "
                               f"export it or remove it from `secrets`")
        environment[secret] = os.environ[secret]
    return {**environment, **reward.env}


@runtime_checkable
class Sandbox(Protocol):
    """One sandbox server process or container."""

    name: str

    @property
    def endpoint(self) -> "Endpoint":
        """Where its gRPC service answers (target and credentials); stable across restarts."""

    def start(self) -> None:
        """Launches the server; returns without waiting for it to be healthy.

        Raises:
            BackendError: it could not be launched.
        """

    def alive(self) -> bool:
        """Whether the process/container is still running."""

    def restart(self) -> None:
        """Stops (if needed) and launches again at the same endpoint."""

    def stop(self) -> None:
        """Stops and removes everything it started. Idempotent."""

    def logs(self, tail: int = 40) -> str:
        """The server's last output lines, for error messages."""


class ExternalSandbox:
    """A sandbox server someone else runs (an orchestrator, a shared service), reached at ``endpoint``: starting and
    stopping it are no-ops here, and it counts as alive (health tells the rest). Subclasses say what ``restart``
    means and where its output is."""

    def __init__(self, name: str, endpoint: "Endpoint"):
        self.name = name
        self._endpoint = endpoint

    @property
    def endpoint(self) -> "Endpoint":
        return self._endpoint

    def start(self) -> None:
        pass

    def alive(self) -> bool:
        return True

    def restart(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        pass

    def logs(self, tail: int = 40) -> str:
        raise NotImplementedError


@runtime_checkable
class Backend(Protocol):
    """Where sandboxes run. Made from its settings section by its registered factory."""

    name: str
    isolated: bool  # False: reward code runs with the trainer's rights

    def prepare(self, rewards: Sequence["RewardSpec"]) -> None:
        """Everything before sandboxes start (image builds). Raises ImageBuildError naming the package."""

    def create(self, reward: "RewardSpec", replica: int) -> Sandbox:
        """A not-yet-started sandbox for one replica of a reward."""

    def close(self) -> None:
        """Releases what the backend created itself (sandboxes are stopped by their owner)."""

"""The ``attached`` backend: a sandbox server that something else started and keeps running, reached at a socket.

This is the gateway's side of a Kubernetes pod (``rewardbox deploy kubernetes``): the pod's ``sandbox`` container
runs the sandbox server, hardened by the pod's security context, with its socket in a volume the ``gateway``
container shares; the gateway runs ``rewardbox serve`` with::

    sandbox:
      backend: attached
      attached: {target: "unix:///run/rewardbox/grpc.sock"}

Nothing is started, restarted or stopped from here: when the server dies, the orchestrator (the kubelet) starts
it again, and recovery waits for its health (``sandbox.start_timeout_s``) and loads the functions again.
"""

from __future__ import annotations

from typing import Optional, Sequence

from pydantic import Field

from ..registry import BackendType
from ..scoring.transport import Endpoint
from ..spec import RewardSpec
from .base import BackendSettings, ExternalSandbox


class AttachedSettings(BackendSettings):
    """``sandbox.attached:``: where the running sandbox server listens."""

    target: str = Field(default="unix:///run/rewardbox/grpc.sock", description="the sandbox server's gRPC target")


class AttachedSandbox(ExternalSandbox):
    """A sandbox server run by someone else. Its restarts are theirs: ``restart`` only lets recovery wait for it."""

    def __init__(self, name: str, target: str):
        super().__init__(name, Endpoint(target))

    def restart(self) -> None:
        pass  # the orchestrator restarts the server; recovery then waits for its health

    def logs(self, tail: int = 40) -> str:
        return f"(the sandbox server at {self._endpoint.target} is run by its orchestrator: see its container's logs)"


class AttachedBackend:
    name = "attached"
    isolated = True  # as isolated as whatever runs the server: the pod's sandbox container, in its deployment

    def __init__(self, settings: Optional[AttachedSettings] = None):
        self.settings = settings or AttachedSettings()

    def prepare(self, rewards: Sequence[RewardSpec]) -> None:
        pass

    def replica_count(self, reward: RewardSpec) -> int:
        return 1  # one server; more replicas are more pods

    def create(self, reward: RewardSpec, replica: int) -> AttachedSandbox:
        return AttachedSandbox(f"{reward.name}@{self.settings.target}", self.settings.target)

    def close(self) -> None:
        pass


BACKEND = BackendType(
    name="attached",
    settings_type=AttachedSettings,
    create=AttachedBackend,
    isolated=True,
    summary="a sandbox server run by an orchestrator (the gateway container of a Kubernetes pod)",
)

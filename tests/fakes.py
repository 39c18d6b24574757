"""Fakes for the seams, handed in through constructors (no patching).

- ``FakeSandbox`` + ``FakeTransport`` + ``FakeBackend``: an in-memory sandbox whose "server" answers through the
  transport seam, scripted per Score call; the client's splitting, deadlines, retries, recovery and fallbacks run
  against them with no process at all.
- ``UnrestartableBackend``: a real local sandbox whose restarts fail, like an engine that went away.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Union

import grpc

from rewardbox import BackendError
from rewardbox.backends.local import LocalBackend, LocalSandbox
from rewardbox.errors import TransportError
from rewardbox.scoring.transport import Endpoint
from rewardbox.wire import Status
from rewardbox.wire.pb import reward_pb2 as pb

# What a scripted Score call does: fail with a gRPC code, or answer with this function's response.
Step = Union[grpc.StatusCode, Callable[[pb.ScoreRequest], pb.ScoreResponse]]


def answer(values: Callable[[pb.Sample], Optional[float]]) -> Callable[[pb.ScoreRequest], pb.ScoreResponse]:
    """A Score handler that scores each sample with ``values`` (None: no value), status ok."""

    def handle(request: pb.ScoreRequest) -> pb.ScoreResponse:
        scores = []
        for s in request.samples:
            v = values(s)
            scores.append(pb.Score(status=Status.OK.wire) if v is None else pb.Score(value=v, status=Status.OK.wire))
        return pb.ScoreResponse(scores=scores)

    return handle


def length_of_completion(sample: pb.Sample) -> float:
    return float(len(sample.completion))


@dataclass
class FakeSandbox:
    """A sandbox and its server, in memory. ``script`` holds what the next Score calls do (then ``default``)."""

    name: str
    default: Step = field(default_factory=lambda: answer(length_of_completion))
    script: list = field(default_factory=list)
    healthy: bool = True  # what health checks answer while it runs
    running: bool = False
    starts: int = 0
    restarts: int = 0
    stopped: bool = False
    loads: list = field(default_factory=list)  # LoadRequests received
    calls: list = field(default_factory=list)  # (ScoreRequest, deadline in seconds) received
    loaded: set = field(default_factory=set)

    # -- the Sandbox protocol ---------------------------------------------------------------------------------
    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(f"fake:{self.name}")

    def start(self) -> None:
        self.starts += 1
        self.running, self.loaded = True, set()

    def alive(self) -> bool:
        return self.running

    def restart(self) -> None:
        self.restarts += 1
        self.healthy = True
        self.start()

    def stop(self) -> None:
        self.running, self.stopped = False, True

    def logs(self, tail: int = 40) -> str:
        return f"{self.name}: fake server log"

    # -- its server -------------------------------------------------------------------------------------------
    def serve_load(self, request: pb.LoadRequest) -> pb.LoadResponse:
        if not self.running:
            raise TransportError(grpc.StatusCode.UNAVAILABLE, "connection refused")
        self.loads.append(request)
        self.loaded |= {f.name for f in request.functions}
        return pb.LoadResponse(functions=[pb.FunctionInfo(name=f.name) for f in request.functions])

    def serve_score(self, request: pb.ScoreRequest, timeout_s: float) -> pb.ScoreResponse:
        self.calls.append((request, timeout_s))
        if not self.running:
            raise TransportError(grpc.StatusCode.UNAVAILABLE, "connection refused")
        if request.function not in self.loaded:
            raise TransportError(grpc.StatusCode.FAILED_PRECONDITION, f"reward {request.function!r} is not loaded")
        step = self.script.pop(0) if self.script else self.default
        if isinstance(step, grpc.StatusCode):
            raise TransportError(step, f"scripted {step.name}")
        return step(request)


class FakeConnection:
    def __init__(self, sandbox: FakeSandbox):
        self.sandbox = sandbox
        self.closed = False

    def check_health(self, timeout_s: float) -> bool:
        return self.sandbox.running and self.sandbox.healthy

    def load(self, request: pb.LoadRequest, timeout_s: float) -> pb.LoadResponse:
        return self.sandbox.serve_load(request)

    def describe(self, timeout_s: float) -> pb.DescribeResponse:
        return pb.DescribeResponse(server_version="fake")

    async def score(self, request: pb.ScoreRequest, timeout_s: float,
                    wait_for_ready: bool = False) -> pb.ScoreResponse:
        return self.sandbox.serve_score(request, timeout_s)

    def close(self) -> None:
        self.closed = True


class FakeTransport:
    """Connects to FakeSandboxes by their endpoints' targets."""

    def __init__(self, *sandboxes: FakeSandbox):
        self.sandboxes = {s.endpoint.target: s for s in sandboxes}
        self.connections: list[FakeConnection] = []

    def add(self, sandbox: FakeSandbox) -> None:
        self.sandboxes[sandbox.endpoint.target] = sandbox

    def connect(self, endpoint: Endpoint) -> FakeConnection:
        connection = FakeConnection(self.sandboxes[endpoint.target])
        self.connections.append(connection)
        return connection


class FakeBackend:
    """Makes FakeSandboxes (``make(name)``) and registers each with the transport."""

    name = "fake"
    isolated = False

    def __init__(self, transport: FakeTransport, make: Callable[[str], FakeSandbox] = FakeSandbox):
        self.transport = transport
        self.make = make
        self.sandboxes: list[FakeSandbox] = []
        self.closed = False

    def prepare(self, rewards) -> None:
        pass

    def create(self, reward, replica: int) -> FakeSandbox:
        sandbox = self.make(f"{reward.name}-{replica}")
        self.transport.add(sandbox)
        self.sandboxes.append(sandbox)
        return sandbox

    def close(self) -> None:
        self.closed = True


class UnrestartableSandbox(LocalSandbox):
    """A real local sandbox whose restarts fail, like an engine that went away."""

    restart_calls = 0

    def restart(self) -> None:
        type(self).restart_calls += 1
        raise BackendError("engine gone")


class UnrestartableBackend(LocalBackend):
    def create(self, reward, replica) -> UnrestartableSandbox:
        sandbox = super().create(reward, replica)
        return UnrestartableSandbox(sandbox.name, sandbox._env)

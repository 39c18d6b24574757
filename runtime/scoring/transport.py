"""The transport seam: how the host reaches a sandbox's gRPC service.

A :class:`~rewardbox.backends.Sandbox` hands out an :class:`Endpoint`: a gRPC target plus the credentials to reach
it. A :class:`Transport` turns an endpoint into a :class:`Connection`, one method per RPC. :class:`GrpcTransport` is
the real one: a Unix socket in plaintext today, TCP with TLS and a bearer token for remote sandboxes. Replicas and
the client get their transport through their constructors, so their splitting, deadlines, retries and fallbacks are
unit-tested with a fake (``tests/fakes.py``) and no process at all.

Errors are translated once, here: every failed RPC raises :class:`~rewardbox.errors.TransportError` with the gRPC
status code; nothing above this module sees ``grpc.RpcError``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from dataclasses import dataclass, field
from typing import Optional, Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..errors import TransportError
from ..wire import GRPC_OPTIONS, SERVICE_NAME
from ..wire.pb import reward_pb2 as pb
from ..wire.pb import reward_pb2_grpc as pb_grpc

# gRPC waits 1 s before reconnecting after a failed connect; a sandbox that is starting (or restarting) is up
# well before that, so reconnect quickly. min_reconnect_backoff_ms is also the least time a connection attempt may
# take (gRPC core: the attempt's deadline is the larger of the two): a sandbox forking its warm processes at start
# may take more than a few milliseconds to answer the HTTP/2 handshake.
CHANNEL_OPTIONS = (
    *GRPC_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 20),
    ("grpc.min_reconnect_backoff_ms", 5000),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


@dataclass(frozen=True)
class Endpoint:
    """Where a sandbox serves and how to reach it.

    Attributes:
        target: a gRPC target: ``unix:///path/grpc.sock``, ``host:port`` or ``dns:///name:port``.
        root_certificates: PEM of the CA that signed the server's certificate; set, the channel uses TLS.
        token: sent with every call as ``authorization: Bearer <token>``. Without TLS only over a local
            connection (a Unix socket or loopback), which gRPC enforces.
        server_name: the name the server's TLS certificate must carry, when it is not the target's host.
        client_certificate, client_key: this client's certificate chain and key (PEM), for a service that requires
            client certificates (``rewardbox serve --tls-client-ca``).
    """

    target: str
    root_certificates: Optional[bytes] = field(default=None, repr=False)
    token: Optional[str] = field(default=None, repr=False)
    server_name: Optional[str] = None
    client_certificate: Optional[bytes] = field(default=None, repr=False)
    client_key: Optional[bytes] = field(default=None, repr=False)

    def channel_options(self) -> tuple:
        """gRPC channel options: ours, plus for a TCP target round-robin over every address its name resolves
        to (a service behind one DNS name with several addresses) on connections of this channel's own (gRPC would
        otherwise share one between the channels of a process to the same service, which then sees them as one
        client: its fair shares of ``max_in_flight`` are per connection), and the name TLS expects, if
        overridden."""
        options: tuple[tuple[str, object], ...] = CHANNEL_OPTIONS
        if not self.target.startswith("unix:"):
            options += (("grpc.lb_policy_name", "round_robin"), ("grpc.use_local_subchannel_pool", 1))
        if self.server_name:
            options += (("grpc.ssl_target_name_override", self.server_name),)
        return options


def host_and_port(target: str) -> tuple[str, int]:
    """A target's host and port, any ``scheme://`` before them (as in ``dns:///name:port`` or ``ray://host:port``)
    and an IPv6 address's brackets left out.

    Raises:
        ValueError: the port is not a number.
    """
    host, _, port = target.split("://", 1)[-1].lstrip("/").rpartition(":")
    return host.strip("[]"), int(port)


def tcp_answers(target: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts TCP connections at a target's host and port (:func:`host_and_port`): to tell
    "nothing there" from "not our protocol"."""
    try:
        with socket.create_connection(host_and_port(target), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class Connection(Protocol):
    """The RPCs of one sandbox. Every method raises :class:`TransportError` when the RPC fails (but
    :meth:`check_health`, which answers False)."""

    def check_health(self, timeout_s: float) -> bool:
        """Whether the server reports the reward service SERVING within ``timeout_s``."""

    def load(self, request: pb.LoadRequest, timeout_s: float) -> pb.LoadResponse:
        """Loads (or reloads) functions."""

    def describe(self, timeout_s: float) -> pb.DescribeResponse:
        """What is loaded and installed."""

    async def score(self, request: pb.ScoreRequest, timeout_s: float,
                    wait_for_ready: bool = False) -> pb.ScoreResponse:
        """Scores a batch; ``timeout_s`` is the RPC's deadline. ``wait_for_ready``: wait (within the deadline) for
        a connection that is coming back instead of failing at once."""

    def close(self) -> None:
        """Releases the channels. Idempotent."""


class Transport(Protocol):
    def connect(self, endpoint: Endpoint) -> Connection:
        """A connection to the endpoint. Connecting is lazy: an unreachable endpoint fails on the first RPC."""


def channel_credentials(endpoint: Endpoint) -> Optional[grpc.ChannelCredentials]:
    """The endpoint's credentials, or None for a plaintext channel (no TLS, no token)."""
    if endpoint.root_certificates is None and endpoint.token is None:
        return None
    if endpoint.root_certificates is not None:
        credentials = grpc.ssl_channel_credentials(root_certificates=endpoint.root_certificates,
                                                   private_key=endpoint.client_key,
                                                   certificate_chain=endpoint.client_certificate)
    else:
        local = grpc.LocalConnectionType
        kind = local.UDS if endpoint.target.startswith("unix:") else local.LOCAL_TCP
        credentials = grpc.local_channel_credentials(kind)
    if endpoint.token is not None:
        credentials = grpc.composite_channel_credentials(credentials,
                                                         grpc.access_token_call_credentials(endpoint.token))
    return credentials


class GrpcConnection:
    """A synchronous channel for control RPCs (health, Load, Describe) and one asyncio channel per event loop for
    Score (TRL awaits rewards on its own loop; the CLI runs another)."""

    def __init__(self, endpoint: Endpoint):
        self.endpoint = endpoint
        self._credentials = channel_credentials(endpoint)
        self._options = endpoint.channel_options()
        self._control: Optional[grpc.Channel] = None
        self._aio: dict[asyncio.AbstractEventLoop, tuple[grpc.aio.Channel, pb_grpc.RewardSandboxStub]] = {}
        # Who its calls come from, for a shared service's fair shares of max_in_flight
        # (rewardbox.serve.service.client_of)
        self._client = (("x-rewardbox-client", f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"),)

    def _channel(self) -> grpc.Channel:
        if self._control is None:
            if self._credentials is None:
                self._control = grpc.insecure_channel(self.endpoint.target, options=self._options)
            else:
                self._control = grpc.secure_channel(self.endpoint.target, self._credentials, options=self._options)
        return self._control

    def _stub(self) -> pb_grpc.RewardSandboxStub:
        loop = asyncio.get_running_loop()
        entry = self._aio.get(loop)
        if entry is None:
            for old in [k for k in self._aio if k.is_closed()]:
                del self._aio[old]
            if self._credentials is None:
                channel = grpc.aio.insecure_channel(self.endpoint.target, options=self._options)
            else:
                channel = grpc.aio.secure_channel(self.endpoint.target, self._credentials,
                                                  options=self._options)
            entry = self._aio[loop] = (channel, pb_grpc.RewardSandboxStub(channel))
        return entry[1]

    def check_health(self, timeout_s: float) -> bool:
        try:
            reply = health_pb2_grpc.HealthStub(self._channel()).Check(
                health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=timeout_s
            )
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def load(self, request: pb.LoadRequest, timeout_s: float) -> pb.LoadResponse:
        try:
            return pb_grpc.RewardSandboxStub(self._channel()).Load(request, timeout=timeout_s)
        except grpc.RpcError as e:
            raise TransportError(e.code(), e.details() or "") from None

    def describe(self, timeout_s: float) -> pb.DescribeResponse:
        try:
            return pb_grpc.RewardSandboxStub(self._channel()).Describe(pb.DescribeRequest(), timeout=timeout_s)
        except grpc.RpcError as e:
            raise TransportError(e.code(), e.details() or "") from None

    async def score(self, request: pb.ScoreRequest, timeout_s: float,
                    wait_for_ready: bool = False) -> pb.ScoreResponse:
        try:
            return await self._stub().Score(request, timeout=timeout_s, wait_for_ready=wait_for_ready,
                                            metadata=self._client)
        except grpc.aio.AioRpcError as e:
            raise TransportError(e.code(), e.details() or "") from None

    def close(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        # aio channels belong to their loops (closing needs that loop); dropped, they are closed by grpc's GC.
        self._aio.clear()


class GrpcTransport:
    """The real transport: gRPC channels, plaintext or with TLS and a bearer token as the endpoint says."""

    def connect(self, endpoint: Endpoint) -> GrpcConnection:
        return GrpcConnection(endpoint)

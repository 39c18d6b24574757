"""The ``remote`` backend: rewards served by shared services (``rewardbox serve``) on other machines or pods.

    sandbox:
      backend: remote
      remote:
        endpoints: ["host-a:50051", "host-b:50051"]   # or one DNS name with several addresses
        tls_ca: ca.pem
        token_env: REWARDBOX_TOKEN

Start-up asks every endpoint what it serves (which also proves the TLS and token settings: a wrong token, a missing
CA or a plaintext client against a TLS service fails here, naming the problem, before any sample is scored). Each
reward gets one replica per endpoint that serves it; the client spreads each batch over them, sets aside an
endpoint that fails health and sends its unscored samples to the others (the ``shared`` replicas of
:mod:`rewardbox.scoring.replica` and :mod:`rewardbox.scoring.client`). A DNS name with several addresses is balanced
round-robin by gRPC itself; its dead addresses are skipped. Nothing is started or stopped here: the service owns its
sandboxes.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional, Sequence

import grpc
from pydantic import Field

from ..errors import BackendError, ConfigError, TransportError, read_named_file
from ..registry import BackendType
from ..scoring.transport import Endpoint, GrpcTransport, Transport, host_and_port, tcp_answers
from ..spec import RewardSpec
from .base import BackendSettings, ExternalSandbox

log = logging.getLogger("rewardbox")

PROBE_TIMEOUT_S = 10.0


class RemoteSettings(BackendSettings):
    """``sandbox.remote:``: the shared services (``rewardbox serve``) to score on."""

    endpoints: list[str] = Field(default_factory=list, description="host:port of each `rewardbox serve` (or a DNS "
                                 "name with several addresses, dns:///name:port)")
    tls_ca: Optional[Path] = Field(default=None, description="PEM of the CA that signed the services' certificates; "
                                   "unset: plaintext (loopback services only)")
    tls_server_name: Optional[str] = Field(default=None, description="the name the services' certificates carry, "
                                           "when it is not the endpoint's host")
    tls_client_cert: Optional[Path] = Field(default=None, description="this trainer's client certificate chain "
                                            "(PEM), for services started with --tls-client-ca")
    tls_client_key: Optional[Path] = Field(default=None, description="the client certificate's private key (PEM)")
    token_env: Optional[str] = Field(default=None, description="environment variable holding the services' token")
    max_wait_s: float = Field(default=600.0, ge=0, description="how long samples may wait for a reward's "
                              "max_in_flight budget before they fall back to default_score")


class RemoteSandbox(ExternalSandbox):
    """One endpoint of a shared service, as one replica of a reward. The service is not ours: it is never started,
    restarted or stopped from here."""

    shared = True

    def __init__(self, name: str, endpoint: Endpoint, max_wait_s: float):
        super().__init__(name, endpoint)
        self.max_wait_s = max_wait_s

    def restart(self) -> None:
        raise BackendError(f"{self.name}: a shared service is restarted by whoever runs it, not by its clients")

    def logs(self, tail: int = 40) -> str:
        return f"(the service's output is on the machine that runs it: {self._endpoint.target})"


class RemoteBackend:
    """Shared services, reached over gRPC with TLS and a token.

    Raises:
        ConfigError: no endpoints, or the CA file cannot be read.
        BackendError: the token's environment variable is not set.
    """

    name = "remote"
    isolated = True  # the services isolate reward code (hardened containers, by their own config)

    def __init__(self, settings: Optional[RemoteSettings] = None, transport: Optional[Transport] = None):
        self.settings = settings or RemoteSettings()
        self.transport = transport or GrpcTransport()
        if not self.settings.endpoints:
            raise ConfigError("sandbox.remote.endpoints is empty: list the host:port of each `rewardbox serve`")
        ca = None
        if self.settings.tls_ca is not None:
            ca = read_named_file(self.settings.tls_ca, "sandbox.remote.tls_ca")
        client_cert = client_key = None
        if (self.settings.tls_client_cert is None) != (self.settings.tls_client_key is None):
            raise ConfigError("sandbox.remote.tls_client_cert and tls_client_key go together: give both (the client "
                              "certificate chain and its key, PEM), or neither")
        if self.settings.tls_client_cert is not None:
            assert self.settings.tls_client_key is not None  # they go together (checked above)
            if ca is None:
                raise ConfigError("sandbox.remote.tls_client_cert needs TLS: set sandbox.remote.tls_ca to the CA "
                                  "that signed the services' certificates")
            client_cert = read_named_file(self.settings.tls_client_cert, "sandbox.remote.tls_client_cert")
            client_key = read_named_file(self.settings.tls_client_key, "sandbox.remote.tls_client_key")
        token = None
        if self.settings.token_env:
            token = os.environ.get(self.settings.token_env)
            if not token:
                raise BackendError(f"sandbox.remote.token_env names {self.settings.token_env}, which is not set: "
                                   f"export {self.settings.token_env}=<the token the services were started with>")
        self.endpoints = [Endpoint(t, ca, token, self.settings.tls_server_name, client_cert, client_key)
                          for t in self.settings.endpoints]
        self.serves: dict[str, set[str]] = {}  # target -> reward names

    def prepare(self, rewards: Sequence[RewardSpec]) -> None:
        """Asks each endpoint what it serves.

        Raises:
            BackendError: an endpoint refused the token or the TLS settings, or none answers.
            ConfigError: a reward is served by no endpoint.
        """
        with ThreadPoolExecutor(max_workers=min(16, len(self.endpoints))) as pool:
            answers = list(pool.map(self._probe, self.endpoints))
        unreachable = []
        for endpoint, (served, problem) in zip(self.endpoints, answers):
            if served is None:
                unreachable.append(f"{endpoint.target} ({problem})")
            else:
                self.serves[endpoint.target] = served
        if not self.serves:
            raise BackendError("no endpoint of sandbox.remote.endpoints answers: " + "; ".join(unreachable) +
                               ". Start `rewardbox serve` there, or fix the addresses.")
        for line in unreachable:
            log.warning("remote endpoint %s: left out; the others serve its rewards", line)
        for reward in rewards:
            if not any(reward.name in served for served in self.serves.values()):
                offered = {t: sorted(s) for t, s in self.serves.items()}
                raise ConfigError(f"reward {reward.name!r}: no endpoint serves it (they serve {offered}); add it "
                                  "to the config of `rewardbox serve`, or remove it here")

    def _probe(self, endpoint: Endpoint) -> tuple[Optional[set], str]:
        """(the reward names it serves, "") or (None, why it is unreachable). Raises BackendError for a
        misconfiguration that retrying cannot fix."""
        connection = self.transport.connect(endpoint)
        try:
            reply = connection.describe(PROBE_TIMEOUT_S)
        except TransportError as e:
            problem = self._explain(endpoint, e)
            if problem is not None:
                raise BackendError(f"remote endpoint {endpoint.target}: {problem}") from None
            return None, e.details or e.code.name
        finally:
            connection.close()
        return {f.name for f in reply.functions}, ""

    def _explain(self, endpoint: Endpoint, error: TransportError) -> Optional[str]:
        """What the user must fix, or None when the endpoint is merely not there (yet)."""
        details = (error.details or "").lower()
        env = self.settings.token_env
        if error.code == grpc.StatusCode.UNAUTHENTICATED:
            if endpoint.token is None:
                return ("the service requires a token, and none is sent: set sandbox.remote.token_env to the "
                        "environment variable that holds it")
            return (f"the service refused the token in ${env}: it must be the token `rewardbox serve` was started "
                    f"with ({env} on that machine)")
        if error.code != grpc.StatusCode.UNAVAILABLE:
            return f"{error.code.name}: {error.details}"
        if endpoint.root_certificates is not None and "wrong_version_number" in details:
            return ("the endpoint speaks plaintext, not TLS: start `rewardbox serve` with --tls-cert and --tls-key "
                    "(or, for a loopback service only, remove sandbox.remote.tls_ca)")
        if endpoint.root_certificates is not None and any(
                k in details for k in ("ssl", "tls", "handshake", "certificate", "wrong_version")):
            return ("the TLS handshake failed: check that sandbox.remote.tls_ca is the CA that signed the service's "
                    "certificate, that the certificate names this host (or set sandbox.remote.tls_server_name), "
                    f"and that the service was started with --tls-cert ({error.details})")
        if endpoint.root_certificates is not None and "socket closed" in details and self._refuses_client(endpoint):
            if endpoint.client_certificate is None:
                return ("the service closes connections right after the TLS handshake: it requires client "
                        "certificates (`rewardbox serve --tls-client-ca`). Set sandbox.remote.tls_client_cert and "
                        "tls_client_key to a certificate that CA signed")
            return (f"the service refused the client certificate {self.settings.tls_client_cert} in the TLS "
                    "handshake: it must be signed by the CA the service's --tls-client-ca names, and be valid now")
        if endpoint.root_certificates is None and tcp_answers(endpoint.target):
            return ("something answers there, but not plaintext gRPC: the service probably uses TLS; set "
                    "sandbox.remote.tls_ca to the CA file that signed its certificate")
        return None

    def _refuses_client(self, endpoint: Endpoint) -> bool:
        """Whether the service completes a TLS handshake with these settings and then closes the connection
        instead of answering HTTP/2: what a service that requires (or rejects) client certificates does (TLS 1.3
        checks the client's certificate after the client's side of the handshake is done)."""
        try:
            host, port = host_and_port(endpoint.target)
            assert endpoint.root_certificates is not None  # asked only of a TLS endpoint
            context = ssl.create_default_context(cadata=endpoint.root_certificates.decode())
            context.set_alpn_protocols(["h2"])
            if self.settings.tls_client_cert is not None:
                context.load_cert_chain(self.settings.tls_client_cert, self.settings.tls_client_key)
            with socket.create_connection((host, port), timeout=5) as raw, \
                    context.wrap_socket(raw, server_hostname=endpoint.server_name or host) as tls:
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                return tls.recv(9) == b""
        except (OSError, ValueError):  # ssl.SSLError is an OSError: another TLS problem, explained above
            return False

    def replica_count(self, reward: RewardSpec) -> int:
        """One replica per endpoint that serves the reward (``replicas`` is the service's to set)."""
        return sum(1 for served in self.serves.values() if reward.name in served)

    def create(self, reward: RewardSpec, replica: int) -> RemoteSandbox:
        endpoints = [e for e in self.endpoints if reward.name in self.serves.get(e.target, ())]
        endpoint = endpoints[replica]
        return RemoteSandbox(f"{reward.name}@{endpoint.target}", endpoint, self.settings.max_wait_s)

    def close(self) -> None:
        pass


BACKEND = BackendType(
    name="remote",
    settings_type=RemoteSettings,
    create=RemoteBackend,
    isolated=True,
    summary="shared services (`rewardbox serve`) over gRPC with TLS and a token; failover across endpoints",
)

"""``rewardbox serve CONFIG --openrlhf HOST:PORT``: OpenRLHF's remote reward protocol over HTTP, in front of the
config's sandboxes.

``POST /get_reward`` with ``{"query": [...], "prompts": [...], "labels": [...]}`` answers ``{"rewards": [...],
"scores": [...], "extra_logs": {...}}`` (:mod:`..integrations.openrlhf` says what each holds). OpenRLHF sends one
rollout per request, many at once: the rollouts of requests that arrive together are scored as one batch per
reward (:class:`..integrations.batching.Gatherer`), and ``GET /stats`` says how many requests, rollouts and
batches there were. A reward that fails gives its ``default_score``: no answer is an error because a reward
misbehaved. The answers:

- 400: the body is not JSON or breaks the protocol (the message names the field);
- 401: a token is set and the request's ``Authorization: Bearer <token>`` header does not carry it;
- 413: the body is larger than the limit, refused on its ``Content-Length`` before it is read (a body without one
  is read up to the limit, then refused);
- 503: more requests (or request bytes) are in flight than the limit (OpenRLHF's client tries again a second
  later), or the sandboxes cannot score at all (their service is gone).

OpenRLHF sends no credentials, so the endpoint binds loopback unless TLS and a token are set up (the rule of
``rewardbox serve``: :class:`.service.ServiceSecurity`); a proxy in front of it adds the token header.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import signal
import ssl
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ..api.session import RewardSandboxes
from ..errors import ConfigError
from ..integrations.batching import MAX_BATCH, Gatherer
from ..integrations.openrlhf import ProtocolError, score
from ..spec import RewardboxConfig
from .service import ServiceSecurity

PATH = "/get_reward"


@dataclass(frozen=True)
class HttpLimits:
    """What the endpoint accepts (``rewardbox serve`` options)."""

    max_body_bytes: int = 16 * 1024 * 1024  # one rollout's query, prompt and label: far less
    max_in_flight: int = 4096  # requests being answered at once; more get 503 at once
    # What the requests being answered may hold together (their bodies' bytes, counted as they arrive): the
    # in-flight limit times the body limit would be 64 GiB. Past it, 503 at once.
    max_in_flight_bytes: int = 256 * 1024 * 1024
    max_rollouts: int = MAX_BATCH  # rollouts in one request (OpenRLHF sends one)
    body_timeout_s: float = 30.0  # a body must have arrived whole within this of its headers (else 408)
    # Connections at once; past it, a new one is closed at once. With max_headers, what connections can make the
    # server hold before any request reaches it (a few hundred KiB each).
    max_connections: int = 1024
    first_request_s: float = 30.0  # a connection with no authorised request by then is closed
    handshake_s: float = 10.0  # a TLS handshake must end within this
    keepalive_s: float = 60.0  # an idle kept-alive connection is closed after this (aiohttp's own: an hour)
    max_headers: int = 32


def _aiohttp():
    try:
        from aiohttp import web
    except ImportError:
        raise ConfigError("rewardbox serve --openrlhf needs aiohttp: pip install 'rewardbox[openrlhf]'") from None
    return web


class Endpoint:
    """The HTTP side: one :class:`Gatherer` over the sandboxes, and the counts ``GET /stats`` shows."""

    def __init__(self, sandboxes: RewardSandboxes, security: ServiceSecurity, limits: HttpLimits = HttpLimits(),
                 gatherer: Optional[Gatherer] = None):
        self.security, self.limits = security, limits
        self.gatherer = gatherer or Gatherer(sandboxes)
        self._expected = f"Bearer {security.token}".encode() if security.token else None
        self.connections = Connections(limits)
        self.in_flight = 0
        self.in_flight_bytes = 0
        self.requests = 0
        self.rollouts = 0

    def app(self):
        web = _aiohttp()
        app = web.Application(client_max_size=self.limits.max_body_bytes)
        app.router.add_post(PATH, self.get_reward)
        app.router.add_get("/stats", self.stats)
        return app

    def _refusal(self, request) -> Optional[Any]:
        """The answer to a request without the token, refused before its body is read; None for one with it,
        whose connection then stays (:class:`Connections`)."""
        web = _aiohttp()
        if self._expected is not None:
            # aiohttp decodes headers with surrogateescape: a byte that is not UTF-8 stays one here (and refuses)
            presented = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(presented, self._expected):
                return web.json_response({"error": "missing or wrong token: send Authorization: Bearer <token> "
                                                   "(the token rewardbox serve was started with)"}, status=401,
                                         headers={"WWW-Authenticate": "Bearer"})
        self.connections.served(request.transport)
        return None

    async def stats(self, request):
        web = _aiohttp()
        refused = self._refusal(request)
        if refused is not None:
            return refused
        return web.json_response({"requests": self.requests, "rollouts": self.rollouts,
                                  "batches": self.gatherer.batches, "in_flight": self.in_flight})

    async def get_reward(self, request):
        web = _aiohttp()
        refused = self._refusal(request)
        if refused is not None:
            return refused
        length = request.content_length
        if length is not None and length > self.limits.max_body_bytes:
            return _error(web, 413, f"the body is {length} bytes, over the limit of {self.limits.max_body_bytes} "
                                    "(rewardbox serve --openrlhf-max-body-mb)")
        if self.in_flight >= self.limits.max_in_flight:
            return _error(web, 503, f"{self.in_flight} requests are in flight, the limit "
                                    "(rewardbox serve --openrlhf-max-in-flight); try again", {"Retry-After": "1"})
        self.in_flight += 1
        body = _Body()
        try:
            try:
                await asyncio.wait_for(self._read(request, body), self.limits.body_timeout_s)
            except asyncio.TimeoutError:
                return _error(web, 408, f"the body did not arrive within {self.limits.body_timeout_s:g} s")
            except ConnectionError:  # the client went away mid-body: nobody reads an answer
                return web.Response(status=400)
            if body.refused is not None:
                return body.refused
            try:
                data = json.loads(b"".join(body.chunks))
            except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, or nested past the parser's depth
                return _error(web, 400, f"the body is not JSON: {type(e).__name__}: {str(e)[:200]}")
            if not isinstance(data, dict):
                return _error(web, 400, 'the body must be a JSON object with "query", "prompts" and "labels"')
            queries = data.get("query")
            if isinstance(queries, list) and len(queries) > self.limits.max_rollouts:
                return _error(web, 400, f'"query" holds {len(queries)} rollouts, over the limit of '
                                        f"{self.limits.max_rollouts} in one request")
            self.requests += 1
            try:
                answer = await score(self.gatherer, queries, data.get("prompts"), data.get("labels"))
            except ProtocolError as e:
                return _error(web, 400, str(e))
            except Exception as e:  # noqa: BLE001 - rewards fall back inside; this is the sandboxes being gone
                return _error(web, 503, f"rewardbox could not score this request: {type(e).__name__}: {e}")
            self.rollouts += len(answer["rewards"])
            return web.json_response(answer)
        finally:
            self.in_flight -= 1
            self.in_flight_bytes -= body.held

    async def _read(self, request, body: "_Body") -> None:
        """Reads the body into ``body``, counting its bytes in flight as they arrive (a connection that declares
        a large body and sends nothing holds nothing); sets ``body.refused`` past a limit."""
        web = _aiohttp()
        async for chunk in request.content.iter_chunked(1 << 16):
            if body.held + len(chunk) > self.limits.max_body_bytes:
                body.refused = _error(web, 413, f"the body is over the limit of {self.limits.max_body_bytes} bytes "
                                                "(rewardbox serve --openrlhf-max-body-mb)")
                return
            if self.in_flight_bytes + len(chunk) > self.limits.max_in_flight_bytes:
                body.refused = _error(web, 503, f"the requests in flight hold {self.in_flight_bytes} bytes, the "
                                                f"limit of {self.limits.max_in_flight_bytes} "
                                                "(--openrlhf-max-in-flight-mb); try again", {"Retry-After": "1"})
                return
            self.in_flight_bytes += len(chunk)
            body.held += len(chunk)
            body.chunks.append(chunk)


class _Body:
    """A request body as it arrives: its chunks, the bytes it holds in flight, and its refusal (None: none)."""

    def __init__(self) -> None:
        self.chunks: list = []
        self.held = 0
        self.refused: Optional[Any] = None


class Connections:
    """The endpoint's connections, gated before aiohttp sees them. Each is counted from its accept (a TLS
    handshake included, which must end within ``handshake_s``), and closed unless an authorised request of it
    reached the app within ``first_request_s``: headers sent slowly or never finished, a handshake that never
    ends, or requests without the token keep no connection. At ``max_connections``, the oldest connection that has
    had no authorised request is closed to make room; when every one has, the new one is closed at once."""

    def __init__(self, limits: HttpLimits):
        self.limits = limits
        self.live: dict = {}  # _Gated -> None, in the order they were accepted (a dict keeps it)
        self.handshake_s = 0.0  # limits.handshake_s where the connections are TLS (set by listening)
        self._by_transport: dict = {}  # id(transport) -> its _Gated, from connection_made to connection_lost

    @property
    def open(self) -> int:
        return len(self.live)

    def served(self, transport) -> None:
        """A request of ``transport``'s connection passed the token check: it stays."""
        gated = self._by_transport.get(id(transport))
        if gated is not None and gated.transport is transport:
            gated.served = True

    def factory(self, make: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """The protocol factory for ``loop.create_server`` (called at each accept, before a TLS handshake):
        ``make``'s protocols (aiohttp's), gated."""
        return lambda: _Gated(self, make())

    def admit(self, gated: "_Gated") -> bool:
        if len(self.live) >= self.limits.max_connections:
            oldest = next((g for g in self.live if not g.served), None)
            if oldest is None:
                return False
            oldest.close()
        self.live[gated] = None
        return True

    def release(self, gated: "_Gated") -> None:
        self.live.pop(gated, None)
        if gated.transport is not None and self._by_transport.get(id(gated.transport)) is gated:
            del self._by_transport[id(gated.transport)]


class _Gated(asyncio.Protocol):
    """One connection's protocol (aiohttp's request handler) behind :class:`Connections`."""

    def __init__(self, gate: Connections, inner: Any):
        self.gate, self.inner = gate, inner
        self.transport: Optional[asyncio.Transport] = None
        self.served = False
        self.made = False
        self.refused = not gate.admit(self)
        # At least the handshake's time: a connection whose handshake never ended is released here (asyncio's
        # handshake timeout closed it, and such a protocol hears nothing of it)
        wait_s = max(gate.limits.first_request_s, gate.handshake_s)
        self.timer = None if self.refused else asyncio.get_running_loop().call_later(wait_s, self._first_request)

    def connection_made(self, transport) -> None:  # a stream transport (create_server's)
        self.transport = transport
        if self.refused:
            transport.abort()
            return
        self.made = True
        self.gate._by_transport[id(transport)] = self
        self.inner.connection_made(transport)

    def close(self) -> None:
        """Made room for a newer connection: closed now, or, mid-handshake, once it is made."""
        self.gate.release(self)
        self.refused = True
        if self.timer is not None:
            self.timer.cancel()
        if self.transport is not None:
            self.transport.abort()

    def _first_request(self) -> None:
        if not self.made:
            self.gate.release(self)
        elif not self.served and self.transport is not None:
            self.transport.abort()

    def connection_lost(self, exc) -> None:
        self.gate.release(self)
        if self.timer is not None:
            self.timer.cancel()
        if self.made:
            self.made = False
            self.inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.inner.data_received(data)

    def eof_received(self) -> Optional[bool]:
        return self.inner.eof_received()

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def _error(web, status: int, message: str, headers: Optional[dict] = None):
    return web.json_response({"error": message}, status=status, headers=headers)


@contextlib.asynccontextmanager
async def listening(endpoint: Endpoint, host: str, port: int, context: Optional[ssl.SSLContext] = None):
    """Serves ``endpoint`` on ``host:port`` (0: any free port) while in the block, which gets the bound port:
    aiohttp's app, with its limits on what one connection may send and hold, behind :class:`Connections`.
    lingering_time 0: a refused body is not read on after the answer (the connection closes instead)."""
    web = _aiohttp()
    limits = endpoint.limits
    runner = web.AppRunner(endpoint.app(), access_log=None, lingering_time=0, keepalive_timeout=limits.keepalive_s,
                           max_headers=limits.max_headers)
    await runner.setup()
    endpoint.connections.handshake_s = limits.handshake_s if context is not None else 0.0
    try:
        assert runner.server is not None  # set up
        server = await asyncio.get_running_loop().create_server(
            endpoint.connections.factory(runner.server), host, port, ssl=context,
            ssl_handshake_timeout=limits.handshake_s if context is not None else None)
        try:
            yield server.sockets[0].getsockname()[1]
        finally:
            server.close()
    finally:
        await runner.cleanup()


def ssl_context(security: ServiceSecurity) -> Optional[ssl.SSLContext]:
    """The endpoint's TLS: the service's certificate, and with a client CA, client certificates required; None
    for plaintext (loopback)."""
    if not security.certificate:
        return None
    assert security.private_key is not None  # they go together (ServiceSecurity.from_options)
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    # ssl loads a chain and key only from files: a private directory of this process's, gone once they are read
    with tempfile.TemporaryDirectory(prefix="rewardbox-tls-") as directory:
        cert, key = Path(directory) / "cert.pem", Path(directory) / "key.pem"
        cert.write_bytes(security.certificate)
        key.write_bytes(security.private_key)
        context.load_cert_chain(cert, key)
    if security.client_ca:
        context.load_verify_locations(cadata=security.client_ca.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    return context


async def serve_openrlhf(config: RewardboxConfig, listen: str, security: ServiceSecurity,
                         limits: HttpLimits = HttpLimits(),
                         on_ready: Optional[Callable[[RewardSandboxes, int], None]] = None,
                         stop: Optional[asyncio.Event] = None) -> None:
    """Starts the config's sandboxes, serves OpenRLHF's protocol on ``listen`` until SIGTERM/SIGINT (or ``stop``),
    then stops everything.

    Raises:
        ConfigError (aiohttp missing among them), RewardLoadError, ImageBuildError, BackendError: start-up failed;
        nothing is left running.
        OSError: the address cannot be bound.
    """
    _aiohttp()  # missing: say so before anything starts
    host, port = listen.rsplit(":", 1)
    context = ssl_context(security)
    sandboxes = RewardSandboxes(config)
    await asyncio.to_thread(sandboxes.start)
    try:
        endpoint = Endpoint(sandboxes, security, limits)
        async with listening(endpoint, host.strip("[]"), int(port), context) as bound:
            stop = stop or asyncio.Event()
            for sig in (signal.SIGTERM, signal.SIGINT):
                asyncio.get_running_loop().add_signal_handler(sig, stop.set)
            if on_ready is not None:
                on_ready(sandboxes, bound)
            await stop.wait()
    finally:
        await asyncio.to_thread(sandboxes.stop)

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
    # What the requests being answered may hold together (their bodies as declared, or the body limit for one that
    # declares none): the in-flight limit times the body limit would be 64 GiB. Past it, 503 at once.
    max_in_flight_bytes: int = 256 * 1024 * 1024
    max_rollouts: int = MAX_BATCH  # rollouts in one request (OpenRLHF sends one)


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
        """The answer to a request refused before its body is read, or None."""
        web = _aiohttp()
        if self._expected is not None:
            presented = request.headers.get("Authorization", "").encode()
            if not hmac.compare_digest(presented, self._expected):
                return web.json_response({"error": "missing or wrong token: send Authorization: Bearer <token> "
                                                   "(the token rewardbox serve was started with)"}, status=401,
                                         headers={"WWW-Authenticate": "Bearer"})
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
        held = self.limits.max_body_bytes if length is None else length
        if self.in_flight_bytes + held > self.limits.max_in_flight_bytes:
            return _error(web, 503, f"the requests in flight hold {self.in_flight_bytes} bytes; this one's "
                                    f"{held} would pass the limit of {self.limits.max_in_flight_bytes}; try again",
                          {"Retry-After": "1"})
        self.in_flight += 1
        self.in_flight_bytes += held
        try:
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                return _error(web, 413, f"the body is over the limit of {self.limits.max_body_bytes} bytes "
                                        "(rewardbox serve --openrlhf-max-body-mb)")
            try:
                data = json.loads(body)
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
            self.in_flight_bytes -= held


def _error(web, status: int, message: str, headers: Optional[dict] = None):
    return web.json_response({"error": message}, status=status, headers=headers)


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
    web = _aiohttp()
    host, port = listen.rsplit(":", 1)
    context = ssl_context(security)
    sandboxes = RewardSandboxes(config)
    await asyncio.to_thread(sandboxes.start)
    try:
        endpoint = Endpoint(sandboxes, security, limits)
        # lingering_time 0: a refused body is not read on after the answer (the connection closes instead)
        runner = web.AppRunner(endpoint.app(), access_log=None, lingering_time=0)
        await runner.setup()
        try:
            site = web.TCPSite(runner, host.strip("[]"), int(port), ssl_context=context)
            await site.start()
            bound = runner.addresses[0][1]
            stop = stop or asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            if on_ready is not None:
                on_ready(sandboxes, bound)
            await stop.wait()
        finally:
            await runner.cleanup()
    finally:
        await asyncio.to_thread(sandboxes.stop)

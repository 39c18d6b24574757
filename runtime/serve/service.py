"""``rewardbox serve``: one authenticated gRPC endpoint in front of a config's sandboxes, shared by many trainers
and ranks.

The service starts the config's rewards exactly as a trainer would (:class:`~rewardbox.api.session.RewardSandboxes` on
the configured backend: hardened containers by default) and answers the sandbox protocol itself (Load, Score,
Describe, gRPC health and reflection), so a trainer reaches it with ``sandbox.backend: remote`` and nothing else
changes:

- **Score** goes to the reward's :class:`~rewardbox.scoring.client.RewardClient` here, which spreads it over the local
  replicas with their deadlines, retries and recovery. Each sample comes back with its own status; a sample the
  local sandboxes could not score comes back ``unavailable`` (never a fallback value), so the trainer's client tries
  it on another service and applies its own ``default_score``.
- **max_in_flight** (per reward) bounds the samples all clients together have running here. A request that finds
  the budget full is refused with RESOURCE_EXHAUSTED; one that fits in part runs that part and returns the rest
  ``deferred``. Clients send deferred samples again after a backoff (a batch-style call is admitted whole or not
  at all: it is never split).
- **Load** replaces the source of a reward this service serves (a trainer's edited file), keeping the service's
  own settings (isolation, workers, limits); an unchanged source is not reloaded, so many ranks starting at once
  cost nothing. Rewards the config does not name cannot be added.
- **Auth**: a configured token is checked on every RPC (health and reflection included) in constant time; TLS
  and a token are required unless the service listens on loopback only.
- **Draining**: SIGTERM or SIGINT sets health NOT_SERVING and refuses new Score calls with UNAVAILABLE (clients move
  their samples to other endpoints), lets the running ones finish, then stops the sandboxes.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
import hmac
import ipaddress
import logging
import math
import os
import platform
import resource
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional, cast

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from ..api.session import RewardSandboxes
from ..errors import ConfigError, RewardboxError, RewardLoadError, read_named_file
from ..spec import RewardboxConfig, RewardSpec
from ..wire import HARD_TIMEOUT_MARGIN_S, MAX_MESSAGE_BYTES, SERVICE_NAME, STYLE_NAMES, VERSION, Status
from ..wire.pb import reward_pb2 as pb
from ..wire.pb import reward_pb2_grpc as pb_grpc

log = logging.getLogger("rewardbox")

TOKEN_ENV = "REWARDBOX_TOKEN"


@dataclass(frozen=True)
class ServiceLimits:
    """What one service accepts, from every client together (``rewardbox serve`` options)."""

    # The largest request: what a batch can need (1,024 completions of 16 KiB each with their prompts and columns
    # fit easily); a larger one is refused with RESOURCE_EXHAUSTED, naming the option.
    max_message_bytes: int = 64 * 1024 * 1024
    max_concurrent_rpcs: int = 256  # RPCs running at once, all connections together; more are refused at once
    max_streams_per_connection: int = 16  # HTTP/2 streams one connection may have open; more wait in the client
    max_connections: int = 512  # connections at once, authenticated or not: more are refused
    # HTTP/2 flow control: what a stream may send before the service asks for its message, so at most what an
    # unauthenticated stream puts into the service's memory before it is refused. Fixed: gRPC's bandwidth probing,
    # which grows windows as data arrives, is off (with it, refused 200 MB requests left tens of MiB each).
    stream_window_bytes: int = 64 * 1024
    idle_s: float = 60.0  # a connection with no call for this long is closed (clients reconnect when they need to)
    handshake_s: float = 10.0  # a connection must finish its TLS and HTTP/2 handshakes within this
    # An environment's episode with no request for this long is ended: a trainer that died without ending its
    # episodes would otherwise hold their sandbox processes (and a place among MAX_EPISODES) while the service runs.
    episode_idle_s: float = 3600.0

    def grpc_options(self) -> list:
        return [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_concurrent_streams", self.max_streams_per_connection),
                ("grpc.max_allowed_incoming_connections", self.max_connections),
                ("grpc.http2.lookahead_bytes", self.stream_window_bytes), ("grpc.http2.bdp_probe", 0),
                ("grpc.max_connection_idle_ms", int(self.idle_s * 1000)),
                ("grpc.server_handshake_timeout_ms", int(self.handshake_s * 1000))]
DRAIN_GRACE_S = 60.0
MAX_EPISODES = 65536  # live environment episodes a service routes (each a few hundred bytes here; a process there)
MAX_EPISODE_ID = 64  # characters (hosts send 32 hex digits)
_OK = Status.OK


def _wire(status: Status) -> pb.Status:
    """``status.wire`` as the stubs type a Score's status: their enum class, an int at run time."""
    return cast(pb.Status, status.wire)


def is_loopback(listen: str) -> bool:
    """Whether ``host:port`` binds loopback only (127.0.0.0/8, ::1 or localhost)."""
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class ServiceSecurity:
    """What clients must present: TLS (the server's certificate chain and key, PEM), a bearer token, and, with a
    client CA, a client certificate that CA signed (mutual TLS).

    With a client CA, a peer without such a certificate is refused in the TLS handshake: it never reaches HTTP/2,
    so it can open no stream, send no header and cost the service nothing of gRPC's per-connection state (the
    token alone is checked only after HTTP/2, per call)."""

    certificate: Optional[bytes] = None
    private_key: Optional[bytes] = None
    token: Optional[str] = None
    client_ca: Optional[bytes] = None

    @classmethod
    def from_options(cls, listen: str, tls_cert: Optional[Path], tls_key: Optional[Path],
                     token_env: str = TOKEN_ENV, tls_client_ca: Optional[Path] = None,
                     option: str = "--listen") -> "ServiceSecurity":
        """Reads the files and the token, enforcing the rule: TLS and a token unless listening on loopback.
        ``option`` names the address's option in errors.

        Raises:
            ConfigError: naming the option, file or variable to fix.
        """
        if ":" not in listen or not listen.rsplit(":", 1)[1].isdigit():
            raise ConfigError(f"{option} {listen!r}: expected HOST:PORT, e.g. 0.0.0.0:50051 or 127.0.0.1:50051")
        if (tls_cert is None) != (tls_key is None):
            raise ConfigError("--tls-cert and --tls-key go together: give both (the certificate chain and its key, "
                              "PEM), or neither (loopback only)")
        if tls_client_ca is not None and tls_cert is None:
            raise ConfigError("--tls-client-ca needs TLS: give --tls-cert and --tls-key too (client certificates "
                              "are checked in the TLS handshake)")
        certificate = private_key = client_ca = None
        if tls_cert is not None:
            assert tls_key is not None  # they go together (checked above)
            certificate = read_named_file(tls_cert, "--tls-cert")
            private_key = read_named_file(tls_key, "--tls-key")
        if tls_client_ca is not None:
            client_ca = read_named_file(tls_client_ca, "--tls-client-ca")
            if b"-----BEGIN CERTIFICATE-----" not in client_ca:
                raise ConfigError(f"--tls-client-ca {tls_client_ca}: not a PEM certificate (expected the CA that "
                                  "signs the trainers' client certificates, -----BEGIN CERTIFICATE-----)")
        token = os.environ.get(token_env) or None
        if not is_loopback(listen):
            missing = [what for what, have in (("TLS (--tls-cert and --tls-key)", certificate),
                                               (f"a token (export {token_env}=...)", token)) if not have]
            if missing:
                raise ConfigError(f"{option} {listen}: other machines can reach this address, so the service needs "
                                  f"{' and '.join(missing)}; or listen on 127.0.0.1 for this machine only")
        return cls(certificate, private_key, token, client_ca)

    def describe(self) -> str:
        tls = ("mutual TLS" if self.client_ca else "TLS") if self.certificate else "plaintext"
        return f"{tls}, {'token' if self.token else 'no token'}"

    def server_credentials(self) -> grpc.ServerCredentials:
        """The TLS credentials: the service's certificate, and with a client CA, client certificates required."""
        if self.client_ca:
            return grpc.ssl_server_credentials([(self.private_key, self.certificate)],
                                               root_certificates=self.client_ca, require_client_auth=True)
        return grpc.ssl_server_credentials([(self.private_key, self.certificate)])


class TokenInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every RPC whose ``authorization`` metadata is not ``Bearer <token>``, whatever its method (an unknown
    one included: methods cannot be enumerated) and before anything of its body is read.

    The token is in the call's headers, which arrive before its body; the refusal is a request-streaming handler
    that never asks for a message and has no deserializer. gRPC reads a message only when a handler asks for one
    (a unary handler's request is read before it runs, so refusing with one would first receive the whole body,
    up to the message limit, and parse it). The body's first bytes sit at most in the HTTP/2 flow-control window
    of the stream (:attr:`ServiceLimits.stream_window_bytes`) until the refusal resets it."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(self, continuation, handler_call_details):
        presented = next((v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"), "")
        presented = presented.encode() if isinstance(presented, str) else presented
        if hmac.compare_digest(presented, self._expected):
            return await continuation(handler_call_details)
        return _REFUSING


async def _refuse(request_iterator, context):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                        "missing or wrong token: send the service's token (sandbox.remote.token_env)")
    yield  # pragma: no cover - abort raises


# Request-streaming (no message is read), response-streaming (fits a caller of any shape: only the status is sent),
# bytes in and out (nothing is parsed).
_REFUSING = grpc.stream_stream_rpc_method_handler(_refuse)


CLIENT_HEADER = "x-rewardbox-client"  # the client a call comes from, as it says (one per trainer's connection)


def client_of(context) -> str:
    """Who a call counts as for fair shares: its address without the port (so that opening more connections gets a
    peer no more shares) and the client it says it is (so that trainers behind one address get one each)."""
    peer = context.peer() or ""
    address = peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer
    said = next((v for k, v in context.invocation_metadata() or () if k == CLIENT_HEADER), "")
    return f"{address}/{str(said)[:64]}"


class Budget:
    """Samples of one reward running at once, across every client (``max_in_flight``; None: no bound), shared fairly.

    A client is an address and the client the calls say they come from (:func:`client_of`). While several
    clients want samples run, each may hold at most
    its share: the limit divided among them, rounded up. A client alone may use all of it. A client wants while it
    has samples running, or for :data:`WANT_S` after it was turned away (it is about to send them again). So a
    client that keeps the budget full cannot starve another: as its samples finish, it may not take back more than
    its share, and the freed room goes to the one waiting. Used from the service's event loop only."""

    WANT_S = 5.0

    def __init__(self, limit: Optional[int]):
        self.limit = limit
        self.in_flight = 0
        self.peak = 0
        self.held: dict[str, int] = {}  # client -> samples running
        self.turned_away: dict[str, float] = {}  # client -> when it was last refused room

    def share(self, client: str, now: float) -> int:
        """How many samples ``client`` may hold now."""
        for other, when in list(self.turned_away.items()):
            if now - when >= self.WANT_S:
                del self.turned_away[other]
        wanting = {c for c, k in self.held.items() if k} | set(self.turned_away) | {client}
        assert self.limit is not None  # take() asks only when there is a limit
        return -(-self.limit // len(wanting))

    def take(self, n: int, whole: bool, client: str = "", now: Optional[float] = None) -> int:
        """Admits up to ``n`` samples of ``client`` now; returns how many. ``whole``: all of them or none, except
        that a call larger than the room may run alone (it could never run otherwise)."""
        if self.limit is None:
            k = n
        else:
            now = time.monotonic() if now is None else now
            room = max(0, min(self.limit - self.in_flight, self.share(client, now) - self.held.get(client, 0)))
            if whole:
                k = n if n <= room or self.in_flight == 0 else 0
            else:
                k = min(n, room)
            if k < n:
                self.turned_away[client] = now
        self.in_flight += k
        self.held[client] = self.held.get(client, 0) + k
        self.peak = max(self.peak, self.in_flight)
        return k

    def give(self, k: int, client: str = "") -> None:
        self.in_flight -= k
        left = self.held.get(client, 0) - k
        if left > 0:
            self.held[client] = left
        else:
            self.held.pop(client, None)


class RewardService(pb_grpc.RewardSandboxServicer):
    """The sandbox protocol, answered by the sandboxes of a started :class:`RewardSandboxes`."""

    def __init__(self, sandboxes: RewardSandboxes, health: Optional[HealthServicer] = None,
                 episode_idle_s: float = ServiceLimits.episode_idle_s):
        self.sandboxes = sandboxes
        self.episode_idle_s = episode_idle_s
        self.health = health
        self.specs: dict[str, RewardSpec] = {r.name: r for r in sandboxes.config.rewards}
        self.budgets = {name: Budget(spec.max_in_flight) for name, spec in self.specs.items()}
        self.draining = False
        self.active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._load_lock = asyncio.Lock()
        # Environments: each live episode's replica (its calls must reach the one sandbox process that holds it),
        # by episode id; an episode's end removes it. Bounded: a start past MAX_EPISODES live is refused.
        self._episodes: collections.OrderedDict = collections.OrderedDict()  # (env, id) -> (replica, last request)
        self._episode_locks: dict = {}  # (env, id) -> [lock, requests holding or waiting for it]
        self._load_gates: dict[str, asyncio.Lock] = {}  # environment -> held while its map changes or it loads
        self._rotation = 0
        self._endings: set = set()  # tasks ending idle episodes

    def _served(self) -> str:
        return ", ".join(self.specs)

    async def Score(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        started = time.monotonic()
        name = request.function
        if name not in self.specs:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"this service does not serve a reward named {name!r}; "
                                f"it serves {self._served()}")
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the service is draining (shutting down)")
        reward, budget = self.sandboxes[name], self.budgets[name]
        if self.specs[name].style == "environment":
            return await self._episode(request, context)
        n = len(request.samples)
        peer = client_of(context)
        admitted = budget.take(n, whole=reward.style == "batch", client=peer)
        if n and not admitted:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"reward {name!r}: max_in_flight={budget.limit} samples are running; send again later")
        self.active += 1
        self._idle.clear()
        try:
            state = request.trainer_state if request.has_trainer_state else None
            report = await reward.client.score(list(request.samples[:admitted]), state,
                                               details=request.sample_details)
        finally:
            budget.give(admitted, client=peer)
            self.active -= 1
            if not self.active:
                self._idle.set()
        scores = []
        own_logs = report.sample_logs or [""] * len(report.values)
        times = report.sample_seconds or [None] * len(report.values)
        for value, status, error, own, took in zip(report.values, report.statuses, report.errors, own_logs, times):
            if status is _OK and isinstance(value, str):  # a tool's result (its client re-checks it)
                scores.append(pb.Score(result_json=value, status=_wire(status), logs=own, seconds=took))
            elif status is _OK:
                scores.append(pb.Score(value=value, status=_wire(status), logs=own, seconds=took) if value is not None
                              else pb.Score(status=_wire(status), logs=own, seconds=took))
            else:  # the trainer's client applies its own default_score
                scores.append(pb.Score(status=_wire(status), error=error or "", logs=own, seconds=took))
        deferred = pb.Score(status=_wire(Status.UNAVAILABLE), deferred=True,
                            error=f"max_in_flight={budget.limit} reached; not attempted")
        scores.extend(deferred for _ in range(n - admitted))
        return pb.ScoreResponse(scores=scores, logs=report.logs, metrics=pb.Metrics(
            elapsed_ms=1000 * (time.monotonic() - started), workers_replaced=report.workers_replaced))

    async def _episode(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        """An environment's request, passed whole to the replica that holds its episode: a start goes to the
        replica of the episode it ends (an instance keeps to one sandbox), else to the next in turn; a call of an
        episode this service holds to no replica fails as its process being gone would (``crash``). Requests that
        name the same episode run one after another (a start and an end of one id racing each other left a process
        no entry named: red team)."""
        name, episode, ended = request.function, request.episode, request.episode_end
        if len(episode) > MAX_EPISODE_ID or len(ended) > MAX_EPISODE_ID:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"an episode id has at most {MAX_EPISODE_ID} "
                                "characters")
        if (episode and len(request.samples) != 1) or (request.episode_start and not episode):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "an episode's request carries its id and one call")
        if not (math.isfinite(request.timeout_s) and request.timeout_s > 0):  # refused there after the map changed
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "timeout_s must be a positive number of seconds")
        request.timeout_s = min(request.timeout_s, self.specs[name].timeout_s)  # the service's own limit
        keys = sorted({(name, e) for e in (episode, ended) if e})
        async with contextlib.AsyncExitStack() as stack:
            for key in keys:  # in one order: no two requests wait on each other
                await stack.enter_async_context(self._episode_lock(key))
            return await self._route(request, context)

    @contextlib.asynccontextmanager
    async def _episode_lock(self, key: tuple):
        entry = self._episode_locks.setdefault(key, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._episode_locks[key]

    async def _route(self, request: pb.ScoreRequest, context) -> pb.ScoreResponse:
        name, episode, ended = request.function, request.episode, request.episode_end
        replicas = self.sandboxes.replicas[name]
        key = (name, episode)
        async with self._loading(name):  # no episode starts while a new version loads (it would end with the old)
            self._end_idle_episodes()
            if request.episode_start and key in self._episodes:  # refused before the map changes
                await context.abort(grpc.StatusCode.ALREADY_EXISTS, f"environment {name!r}: an episode of that id "
                                    "is live; a new episode takes a new id")
            ending = self._episodes.pop((name, ended), (None, 0.0))[0] if ended else None
            held = ending
            if request.episode_start:
                if len(self._episodes) >= MAX_EPISODES:
                    if ending is not None:
                        self._end_later(ending, name, ended)
                    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"environment {name!r}: "
                                        f"{MAX_EPISODES} episodes are live on this service; end some (the next reset "
                                        "of an instance ends its last)")
                if held is None or held not in replicas:
                    self._rotation += 1
                    held = replicas[self._rotation % len(replicas)]
                self._episodes[key] = (held, time.monotonic())
            elif episode:
                held = self._episodes.get(key, (None, 0.0))[0]
                if held is None:
                    return pb.ScoreResponse(scores=[pb.Score(status=_wire(Status.CRASH), error="this service holds "
                                                             "no live episode of that id (its process is gone, or it "
                                                             "ended)")])
            elif held is None:
                return pb.ScoreResponse()  # the end of an episode no replica holds: nothing to end
        self.active += 1
        self._idle.clear()
        answered = False
        try:
            reply = await held.score(request, request.timeout_s + HARD_TIMEOUT_MARGIN_S + 10.0)
            answered = True
            return reply
        except RewardboxError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"environment {name!r}: its sandbox could not be "
                                f"reached: {e}")
            raise  # abort raises; for type checkers
        finally:
            if not answered:  # failed, or cancelled by its client: what it started or ended may have happened there
                if request.episode_start:
                    self._episodes.pop(key, None)
                    self._end_later(held, name, episode)
                if ending is not None:
                    self._end_later(ending, name, ended)
            elif key in self._episodes:  # its last request: idle from its end, not its start
                self._episodes[key] = (held, time.monotonic())
                self._episodes.move_to_end(key)
            self.active -= 1
            if not self.active:
                self._idle.set()

    def _loading(self, name: str) -> asyncio.Lock:
        """The lock a new version of environment ``name`` loads under, and that routing takes to change the map."""
        return self._load_gates.setdefault(name, asyncio.Lock())

    def _end_idle_episodes(self) -> None:
        """Ends the episodes that had no request for ``episode_idle_s`` (the oldest first: the map is in order of
        use)."""
        now = time.monotonic()
        busy = 0  # episodes with a request under way or waiting (moved to the end: idle from when it ends)
        while self._episodes:
            episode, (replica, used) = next(iter(self._episodes.items()))
            if now - used < self.episode_idle_s:
                break
            if episode in self._episode_locks:
                busy += 1
                self._episodes.move_to_end(episode)
                if busy >= len(self._episodes):
                    break
                continue
            del self._episodes[episode]
            log.info("environment %s: ending an episode idle for %.0f s (its trainer is gone?)", episode[0],
                     now - used)
            self._end_later(replica, *episode)

    def _end_later(self, replica, name: str, episode: str) -> None:
        """Sends ``episode``'s end to ``replica`` without waiting for it."""
        end = pb.ScoreRequest(function=name, timeout_s=self.specs[name].timeout_s, episode_end=episode)
        task = asyncio.ensure_future(self._end_quietly(replica, end))
        self._endings.add(task)
        task.add_done_callback(self._endings.discard)

    @staticmethod
    async def _end_quietly(replica, request: pb.ScoreRequest) -> None:
        try:
            await replica.score(request, 10.0)
        except RewardboxError:
            pass  # a sandbox that cannot be reached has no episode to end

    async def Load(self, request: pb.LoadRequest, context) -> pb.LoadResponse:
        for fn in request.functions:
            spec = self.specs.get(fn.name)
            if spec is None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"this service does not serve a reward named {fn.name!r} (it serves "
                                    f"{self._served()}); add it to the config of `rewardbox serve`")
            assert spec is not None  # context.abort raised
            style = STYLE_NAMES.get(fn.style, "unknown")
            if style != spec.style:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"reward {fn.name!r} is style {spec.style!r} on this service but {style!r} in "
                                    "your config; use the same config on both sides")
        infos = []
        async with self._load_lock:  # ranks starting together send the same source: load it once
            for fn in request.functions:
                async with self._loading(fn.name):  # no episode starts meanwhile (environments route under it)
                    infos.append(await self._load_one(fn, context))
        return pb.LoadResponse(functions=[i for i in infos if i is not None])

    async def _load_one(self, fn: pb.FunctionSource, context):
        """Loads ``fn`` unless it is what runs already; returns its info."""
        current = self.sandboxes.source(fn.name)
        if (fn.source, fn.function) == (current.source, current.function):
            return self.sandboxes[fn.name].info
        live = sum(1 for env, _ in self._episodes if env == fn.name)
        if live:  # a new version restarts the environment's processes: every trainer's live episodes would end
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"environment {fn.name!r} runs another version "
                                f"of its source on this service, with {live} live episode(s); it loads a new version "
                                "only while none is live. Use the source the service runs (its config's "
                                f"{current.filename}, unless a client loaded another), or wait until its episodes end")
        new = pb.FunctionSource()
        new.CopyFrom(current)  # the service's own settings: isolation, workers, warm, limits
        new.source, new.filename, new.function = fn.source, fn.filename, fn.function
        try:
            await asyncio.to_thread(self.sandboxes.load_source, fn.name, new)
        except RewardLoadError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        log.warning("reward %s: a client loaded a new version (%s)", fn.name, fn.filename)
        return self.sandboxes[fn.name].info

    async def Describe(self, request: pb.DescribeRequest, context) -> pb.DescribeResponse:
        return pb.DescribeResponse(
            server_version=VERSION, python_version=sys.version.split()[0], platform=platform.platform(),
            functions=[r.info for r in self.sandboxes.rewards if r.info is not None])

    async def drain(self, grace_s: float) -> None:
        """Stops taking Score calls and waits (at most ``grace_s``) for the running ones."""
        self.draining = True
        if self.health is not None:
            await self.health.enter_graceful_shutdown()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._idle.wait(), grace_s)


_M_ARENA_MAX = -8  # mallopt(3)


def limit_malloc_arenas(count: int = 2) -> None:
    """Caps glibc's malloc arenas (by default 8 per core, one per thread that allocates): gRPC's threads receive
    refused requests' first bytes into buffers of their own arenas, which then stay fragmented and grow the service
    a little with every attack (tens of MiB over a few rounds, measured). No-op without glibc."""
    try:
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, count)
    except (OSError, AttributeError):
        pass


def raise_open_files() -> None:
    """Raises this process's descriptor limit to its hard limit (often 1,024 soft): with the soft default, about
    a thousand idle connections locked new clients out before any limit of ours applied (measured)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))


async def serve(config: RewardboxConfig, listen: str, security: ServiceSecurity,
                on_ready: Optional[Callable[[RewardSandboxes, int], None]] = None,
                stop: Optional[asyncio.Event] = None, drain_grace_s: float = DRAIN_GRACE_S,
                limits: ServiceLimits = ServiceLimits()) -> None:
    """Starts the config's sandboxes, serves them on ``listen`` until SIGTERM/SIGINT (or ``stop``), then drains
    and stops everything.

    Args:
        on_ready: called with the started sandboxes and the bound port once the service answers.
    Raises:
        ConfigError, RewardLoadError, ImageBuildError, BackendError: start-up failed; nothing is left running.
        OSError: the address cannot be bound.
    """
    sandboxes = RewardSandboxes(config)
    await asyncio.to_thread(sandboxes.start)
    try:
        interceptors = [TokenInterceptor(security.token)] if security.token else []
        server = grpc.aio.server(options=limits.grpc_options(), interceptors=interceptors,
                                 maximum_concurrent_rpcs=limits.max_concurrent_rpcs)
        health = HealthServicer()
        service = RewardService(sandboxes, health, limits.episode_idle_s)
        pb_grpc.add_RewardSandboxServicer_to_server(service, server)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
        if security.certificate:
            port = server.add_secure_port(listen, security.server_credentials())
        else:
            port = server.add_insecure_port(listen)
        if not port:
            raise OSError(f"cannot listen on {listen}")
        await server.start()
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
        await health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        stop = stop or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread (tests)
                loop.add_signal_handler(sig, stop.set)
        if on_ready is not None:
            on_ready(sandboxes, port)
        await stop.wait()
        log.warning("rewardbox serve: draining (%d calls running)", service.active)
        await service.drain(drain_grace_s)
        await server.stop(grace=5)
    finally:
        await asyncio.to_thread(sandboxes.stop)

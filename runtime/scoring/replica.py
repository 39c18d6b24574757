"""``Replica``: one running sandbox of a reward, the functions loaded into it, and its recovery.

Lifecycle calls are synchronous (subprocesses and docker-py are); the async scoring path calls them through
``asyncio.to_thread``. RPCs go through a :class:`~rewardbox.scoring.transport.Connection` from the replica's transport.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from pathlib import Path
from typing import Optional, Sequence

import grpc

from ..backends.base import Sandbox
from ..errors import BackendError, RewardLoadError, TransportError
from ..spec import RewardSpec
from ..wire.pb import reward_pb2 as pb
from .transport import Connection, GrpcTransport, Transport

_ISOLATION = {"sample": pb.ISOLATION_SAMPLE, "process": pb.ISOLATION_PROCESS, "worker": pb.ISOLATION_WORKER}

log = logging.getLogger("rewardbox")

RECHECK_S = 5.0  # a shared service set aside after failing health is tried again after this long


def function_source(reward: RewardSpec, path: Path) -> pb.FunctionSource:
    """The Load message for a reward, reading its source file now."""
    return pb.FunctionSource(
        name=reward.name,
        filename=str(path),
        source=path.read_text(),
        function=reward.function_name,
        style=pb.Style.Value(f"STYLE_{reward.style.upper()}"),
        isolation=_ISOLATION[reward.isolation],
        warm=reward.warm or 0,  # 0: the sandbox's default
        workers=reward.workers,
        concurrency=reward.concurrency,
        max_log_bytes=reward.max_log_bytes,
        args_json=json.dumps(reward.args) if reward.args is not None else "",
    )


def _with_sibling_hint(message: str, functions: Sequence[pb.FunctionSource]) -> str:
    """A missing module that is a file beside the reward on the host is not a package: say so."""
    for name in re.findall(r"No module named '([\w.]+)'", message):
        top = name.split(".")[0]
        for f in functions:
            folder = Path(f.filename).parent
            if (folder / f"{top}.py").exists() or (folder / top / "__init__.py").exists():
                message += (f"\n{top!r} is a module beside {f.filename} on the host, but a sandbox receives only "
                            "the reward's own file: inline what it needs, or make it a package (a folder with a "
                            "pyproject.toml) and list that folder in `packages`, e.g. `packages: [./my_helpers]`.")
                break
    return message


class Replica:
    """One sandbox and the connection to it."""

    def __init__(self, sandbox: Sandbox, functions: Sequence[pb.FunctionSource], start_timeout_s: float = 60.0,
                 transport: Optional[Transport] = None):
        self.sandbox = sandbox
        self.functions = list(functions)
        self.start_timeout_s = start_timeout_s
        self.transport = transport or GrpcTransport()
        self.restarts = 0
        # Set by a recovery that found (or made) the sandbox healthy, until a Score gets through: its connection
        # may still be in gRPC's reconnect backoff, so the next Score waits for it instead of failing at once.
        self.reconnecting = False
        self._connection: Optional[Connection] = None
        self._recover_lock = threading.Lock()
        self._generation = 0  # bumps on every recovery, so concurrent failures recover once
        self.infos: dict[str, pb.FunctionInfo] = {}  # what the sandbox said of each loaded function
        # A shared service (remote backend) is not ours to restart: one that fails health is set aside (for
        # RECHECK_S) and its samples go to the other replicas; it also relays `unavailable` and `deferred`.
        self.shared = bool(getattr(sandbox, "shared", False))
        self.down_since: Optional[float] = None

    @property
    def name(self) -> str:
        return self.sandbox.name

    @property
    def connection(self) -> Connection:
        if self._connection is None:
            self._connection = self.transport.connect(self.sandbox.endpoint)
        return self._connection

    @property
    def generation(self) -> int:
        return self._generation

    def usable(self) -> bool:
        """False while a shared service that failed health is set aside (it is tried again after RECHECK_S)."""
        return self.down_since is None or time.monotonic() - self.down_since >= RECHECK_S

    def healthy(self, timeout_s: float = 2.0) -> bool:
        return self.sandbox.alive() and self.connection.check_health(timeout_s)

    def wait_healthy(self) -> None:
        """Blocks until the server answers health checks.

        Raises:
            BackendError: it exited, or is not healthy within start_timeout_s; carries its last log lines.
        """
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if not self.sandbox.alive():
                raise BackendError(f"sandbox {self.name} exited during start-up. Its last output:\n"
                                   f"{self.sandbox.logs()}")
            if self.healthy(timeout_s=min(2.0, max(0.1, deadline - time.monotonic()))):
                return
            time.sleep(0.05)
        raise BackendError(f"sandbox {self.name} did not become healthy within {self.start_timeout_s:g}s "
                           f"(sandbox.start_timeout_s). Its last output:\n{self.sandbox.logs()}")

    def load(self, functions: Optional[Sequence[pb.FunctionSource]] = None) -> pb.LoadResponse:
        """Loads (or reloads) functions; remembers them for recovery.

        Raises:
            RewardLoadError: a function cannot be used (message names file and line).
            BackendError: the sandbox did not answer.
        """
        functions = list(functions) if functions is not None else self.functions
        try:
            reply = self.connection.load(pb.LoadRequest(functions=functions), timeout_s=self.start_timeout_s)
        except TransportError as e:
            if e.code == grpc.StatusCode.INVALID_ARGUMENT:
                raise RewardLoadError(_with_sibling_hint(e.details, functions)) from None
            raise BackendError(f"sandbox {self.name}: Load failed: {e}") from e
        by_name = {f.name: f for f in self.functions}
        by_name.update({f.name: f for f in functions})
        self.functions = list(by_name.values())
        self.infos.update({info.name: info for info in reply.functions})
        return reply

    def describe(self, timeout_s: float = 10.0) -> pb.DescribeResponse:
        """Raises TransportError when the sandbox does not answer."""
        return self.connection.describe(timeout_s)

    async def score(self, request: pb.ScoreRequest, timeout_s: float,
                    wait_for_ready: bool = False) -> pb.ScoreResponse:
        """One Score RPC with deadline ``timeout_s``. Raises TransportError."""
        reply = await self.connection.score(request, timeout_s, wait_for_ready or self.reconnecting)
        self.reconnecting = False
        self.down_since = None
        return reply

    def start(self) -> None:
        """Starts the sandbox, waits for health and loads the functions; stops it again if any step fails."""
        self.sandbox.start()
        try:
            self.wait_healthy()
            self.load()
        except BaseException:
            self.stop()
            raise

    def recover(self, seen_generation: int, reload: bool = False) -> None:
        """Brings the sandbox back after a transient failure: restart it (and load the functions) if it is not
        healthy; only reload when asked (the server said a function is not loaded). A healthy server that was
        merely slow is left alone.

        Several callers may fail at once; only the first (by generation) acts.
        """
        with self._recover_lock:
            if self._generation != seen_generation:
                return
            self._generation += 1
            if not self.healthy():
                if self.shared:
                    log.warning("service %s is not healthy; its samples go to the other endpoints", self.name)
                    self.down_since = time.monotonic()
                    return
                log.warning("sandbox %s is not healthy; restarting it. Last output:\n%s", self.name,
                            self.sandbox.logs(tail=10))
                self._disconnect()
                self.restarts += 1
                self.sandbox.restart()
                self.wait_healthy()
                reload = True
            if reload:
                self.load()
            self.reconnecting = True

    def _disconnect(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            connection.close()

    def stop(self) -> None:
        self._disconnect()
        self.sandbox.stop()

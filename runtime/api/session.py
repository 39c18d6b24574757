"""``RewardSandboxes``: starts every reward's sandboxes from a config and stops them all on exit.

    with RewardSandboxes(load_config("rewards.yaml")) as sandboxes:
        trainer = GRPOTrainer(..., reward_funcs=sandboxes.rewards)

Start-up builds images, starts all replicas in parallel, and loads (validates) every reward, so a broken reward
fails here, before any training step. Whatever started is stopped again if any part of start-up fails, on
normal exit, on exceptions and on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Awaitable, Callable, Optional, Sequence

from ..backends import Backend, create_backend
from ..errors import ConfigError, RewardboxError, RewardLoadError
from ..scoring.client import RewardClient
from ..scoring.replica import Replica, function_source
from ..scoring.samples import column_problem
from ..scoring.transport import GrpcTransport, Transport
from ..spec import RewardboxConfig
from ..wire import BATCH_KEYWORDS
from ..wire.pb import reward_pb2 as pb
from .reward import SandboxedReward

log = logging.getLogger("rewardbox")


class RewardSandboxes:
    """Every reward's sandboxes, from a config.

    Args:
        config: the validated config.
        backend: where sandboxes run; by default the one ``config.sandbox.backend`` names, made from its settings
            (and closed by :meth:`stop`; a backend handed in belongs to the caller).
        transport: how the host reaches sandboxes (gRPC by default).
        sleep: the retries' sleep (tests pass one that does not wait).
    """

    def __init__(
        self,
        config: RewardboxConfig,
        backend: Optional[Backend] = None,
        transport: Optional[Transport] = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.config = config
        self.backend = backend
        self._owns_backend = backend is None
        self.transport = transport or GrpcTransport()
        self._sleep = sleep
        self.replicas: dict[str, list[Replica]] = {}
        self.rewards: list[SandboxedReward] = []

    def __enter__(self) -> "RewardSandboxes":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def __getitem__(self, name: str) -> SandboxedReward:
        for r in self.rewards:
            if r.name == name:
                return r
        raise KeyError(name)

    def start(self) -> list[SandboxedReward]:
        """Starts and validates everything; returns the reward callables in config order.

        Raises:
            ConfigError, RewardLoadError, ImageBuildError, BackendError: nothing is left running then.
        """
        settings = self.config.sandbox
        try:
            if self.backend is None:
                self.backend = create_backend(settings)
            # Backends see each reward with its source as an absolute path (one that ships it elsewhere reads it).
            rewards = [r.model_copy(update={"source": self.config.source_path(r)}) for r in self.config.rewards]
            self.backend.prepare(rewards)
            # A backend may decide how many replicas a reward has (remote: the endpoints that serve it).
            count = getattr(self.backend, "replica_count", None)
            for reward in rewards:
                source = function_source(reward, reward.source)
                self.replicas[reward.name] = [
                    Replica(self.backend.create(reward, i), [source], settings.start_timeout_s, self.transport)
                    for i in range(count(reward) if count else reward.replicas)
                ]
            everything = [r for rs in self.replicas.values() for r in rs]
            with ThreadPoolExecutor(max_workers=max(1, min(16, len(everything)))) as pool:
                outcomes = list(pool.map(_start_one, everything))
            errors = [e for e in outcomes if e is not None]
            if errors:
                # Report a load error first: it is the user's to fix, the others are consequences.
                raise next((e for e in errors if isinstance(e, RewardLoadError)), errors[0])
        except BaseException:
            self.stop()
            raise
        self.rewards = [
            SandboxedReward(RewardClient(r, self.replicas[r.name], settings, sleep=self._sleep),
                            self.replicas[r.name][0].infos.get(r.name))
            for r in self.config.rewards
        ]
        return self.rewards

    def check_columns(self, columns: Sequence[str], values: Optional[dict] = None, source: str = "the dataset",
                      rows: bool = False) -> None:
        """Checks, before training, that TRL will pass every reward what it requires: each batch-style parameter
        without a default is a keyword TRL passes or one of ``columns``, and every column a batch-style reward
        gets can reach its sandbox unchanged (``values``: one value per column, e.g. the first row; with
        ``rows``, a list of values per column).

        Raises:
            ConfigError: naming the reward, its file and line, the parameter or column, and the fix.
        """
        passed = set(BATCH_KEYWORDS) | set(columns)
        for reward in self.rewards:
            info = reward.info
            if info is None or reward.style != "batch":
                continue
            where = f"reward {reward.name!r} ({info.filename}, {info.signature})"
            missing = [name for name in info.required_keywords if name not in passed]
            if missing:
                raise ConfigError(
                    f"{where}: parameter {missing[0]!r} has no default, but TRL passes no such keyword: {source} "
                    f"has the columns {', '.join(columns) or 'none'}, and TRL adds {', '.join(BATCH_KEYWORDS)}. "
                    f"Rename the parameter to one of them, add the column, or give it a default.")
            if values is not None:
                problem = column_problem({k: (v if rows else [v]) for k, v in values.items() if k in columns})
                if problem:
                    raise ConfigError(f"{where}: {source}: {problem}")

    def reload(self, name: str) -> None:
        """Re-reads a reward's source file and loads it into all its replicas, keeping the old version on failure.

        Raises:
            RewardLoadError: the new source does not load; the previous version keeps serving.
        """
        reward = next(r for r in self.config.rewards if r.name == name)
        self.load_source(name, function_source(reward, self.config.source_path(reward)))

    def source(self, name: str) -> pb.FunctionSource:
        """The source a reward's replicas run now."""
        return next(f for f in self.replicas[name][0].functions if f.name == name)

    def load_source(self, name: str, source: pb.FunctionSource) -> None:
        """Loads ``source`` into all of a reward's replicas (see :meth:`reload`)."""
        for replica in self.replicas[name]:
            replica.load([source])
        info = self.replicas[name][0].infos.get(name)
        if info is not None:
            self[name].info = info

    def stop(self) -> None:
        """Stops every sandbox; safe to call more than once."""
        everything = [r for rs in self.replicas.values() for r in rs]
        if everything:
            try:
                with ThreadPoolExecutor(max_workers=max(1, min(16, len(everything)))) as pool:
                    list(pool.map(_stop_one, everything))
            except RuntimeError:  # an atexit hook's stop (verl's, OpenRLHF's workers): no new threads by then
                for replica in everything:
                    _stop_one(replica)
        self.replicas.clear()
        if self.backend is not None and self._owns_backend:
            self.backend.close()
            self.backend = None  # a later start() makes a new one


def _start_one(replica: Replica) -> Optional[BaseException]:
    try:
        replica.start()
        return None
    except RewardboxError as e:
        return e
    except Exception as e:  # noqa: BLE001 - reported with the sandbox's name by the caller
        return RewardboxError(f"sandbox {replica.name}: {type(e).__name__}: {e}")


def _stop_one(replica: Replica) -> None:
    try:
        replica.stop()
    except Exception:  # noqa: BLE001 - keep stopping the others
        log.exception("could not stop sandbox %s", replica.name)

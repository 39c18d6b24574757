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
from typing import Awaitable, Callable, Optional

from .backends import Backend, create_backend
from .client import RewardClient
from .errors import RewardboxError, RewardLoadError
from .replica import Replica, function_source
from .reward import SandboxedReward
from .spec import RewardboxConfig
from .transport import GrpcTransport, Transport

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
            self.backend.prepare(self.config.rewards)
            for reward in self.config.rewards:
                source = function_source(reward, self.config.source_path(reward))
                self.replicas[reward.name] = [
                    Replica(self.backend.create(reward, i), [source], settings.start_timeout_s, self.transport)
                    for i in range(reward.replicas)
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
            SandboxedReward(RewardClient(r, self.replicas[r.name], settings, sleep=self._sleep))
            for r in self.config.rewards
        ]
        return self.rewards

    def reload(self, name: str) -> None:
        """Re-reads a reward's source file and loads it into all its replicas, keeping the old version on failure.

        Raises:
            RewardLoadError: the new source does not load; the previous version keeps serving.
        """
        reward = next(r for r in self.config.rewards if r.name == name)
        source = function_source(reward, self.config.source_path(reward))
        for replica in self.replicas[name]:
            replica.load([source])

    def stop(self) -> None:
        """Stops every sandbox; safe to call more than once."""
        everything = [r for rs in self.replicas.values() for r in rs]
        if everything:
            with ThreadPoolExecutor(max_workers=max(1, min(16, len(everything)))) as pool:
                list(pool.map(_stop_one, everything))
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

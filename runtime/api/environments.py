"""``rewardbox.sandboxed_environment``: a TRL environment, each episode a process of its own in a sandbox.

    with rewardbox.sandboxed_environment(CodeEnv, timeout_s=10) as factory:
        GRPOTrainer(..., environment_factory=factory).train()

TRL makes one environment instance per rollout (a pool it reuses across steps), calls ``reset(**row)`` on it
synchronously, exposes its public methods to the model as tools and, when it has one, adds ``get_reward()`` as a
reward. Here each instance TRL makes is a proxy: ``reset`` starts a new episode in a sandbox process prepared ahead
of demand (under a uid of its own, with a private ``/tmp``, the sandbox's limits and no network unless asked),
whose factory makes the real instance there; every later call of the episode (its methods, ``get_reward``) goes to
that process, so the episode keeps its state across calls, and the next ``reset`` ends it: nothing of one episode
reaches another. A call past ``timeout_s``, a crash or a memory kill ends the episode's process: its later calls
raise :class:`~rewardbox.ToolError` (TRL shows the model the text) and ``get_reward`` returns ``default_score``,
until the next ``reset``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import itertools
import json
import logging
import math
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional, Sequence, Union

from pydantic import Field

from ..errors import ConfigError, RewardboxError
from ..report.tool_calls import CALLS
from ..scoring.client import ScoreReport, call_bytes, checked, too_much
from ..scoring.replica import Replica
from ..spec import MEMORY_PATTERN, RewardSpec, Where, memory_bytes, parse_config
from ..wire import HARD_TIMEOUT_MARGIN_S, Status, sandbox_slots
from ..wire.pb import reward_pb2 as pb
from .dropin import _check_settings, _installs, _spec_name, _validate
from .session import RewardSandboxes
from .shipping import Shipper, where
from .tools import ToolError, ended_how, result_of

log = logging.getLogger("rewardbox")

# TRL keeps as many instances as rollouts in flight (per_device_train_batch_size * steps_per_generation); each live
# episode holds a slot process of its own.
DEFAULT_MAX_EPISODES = 64
RESET_ATTEMPTS = 3  # a reset that cannot reach the sandbox is tried again (a new episode each time) before it gives up
NOT_FOR_ENVIRONMENTS = ("style", "weight", "isolation", "workers", "concurrency", "warm")
SPECIAL = ("reset", "get_reward")


def pids_for(max_episodes: int) -> int:
    """The container's process limit that leaves each of ``max_episodes`` live episodes room to fork as a sample
    may (the docker backend's own check: :func:`..backends.docker.slot_plan`), where the user set none."""
    from ..backends.docker import MIN_SLOT_PROCESSES, OWN_PROCESSES

    slots = 2 * sandbox_slots("worker", max_episodes, 0, "environment")  # two versions' (see slot_plan)
    return max(256, slots + 2 * max_episodes * MIN_SLOT_PROCESSES + OWN_PROCESSES)


# What one episode process takes of its container's memory under runc (measured: about 3.3 MiB prepared, 2.3 more
# live, beyond its own state), and what the sandbox takes besides: an environment's default memory limit, where the
# user set none. One set is refused below PROCESS_MIB_AT_LEAST a process (the sandbox could not hold them).
PROCESS_MIB = 6
PROCESS_MIB_AT_LEAST = 4
SANDBOX_MIB = 512


def memory_for(max_episodes: int) -> str:
    """An environment's memory limit where the user set none: its processes (one per live episode, as many prepared
    ahead: :func:`..wire.sandbox_slots`) and the sandbox's own, at least the default of a reward (1g)."""
    mib = sandbox_slots("worker", max_episodes, 0, "environment") * PROCESS_MIB + SANDBOX_MIB
    return f"{max(1024, mib)}m"


def _episode_settings(settings: dict, max_episodes: int) -> dict:
    """An environment's reward settings: the user's, with what an environment fixes (one process per episode, as many
    as ``max_episodes``), and a process limit and memory limit that fit them where the user set none.

    Raises:
        ConfigError: the user's ``memory`` cannot hold the episodes' processes.
    """
    if "memory" in settings:
        slots = sandbox_slots("worker", max_episodes, 0, "environment")
        if not isinstance(settings["memory"], str) or not MEMORY_PATTERN.match(settings["memory"]):
            raise ConfigError(f"environment memory: {settings['memory']!r} is not a size: write it as Docker "
                              "does, e.g. 2g or 1536m")
        if memory_bytes(settings["memory"]) < slots * PROCESS_MIB_AT_LEAST * 2 ** 20:
            raise ConfigError(f"environment memory: {settings['memory']} cannot hold the processes of "
                              f"max_episodes={max_episodes} (one per live episode and one prepared ahead for each, "
                              f"about {PROCESS_MIB} MiB each): set memory to at least {memory_for(max_episodes)}, "
                              "or lower max_episodes")
    return {"pids": pids_for(max_episodes), "memory": memory_for(max_episodes), **settings, "style": "environment",
            "isolation": "worker", "workers": max_episodes}


def _environment_class(factory: Any, label: str) -> type:
    """The class whose methods TRL reads tools from: the factory itself, or a functools.partial of a class."""
    target = factory.func if isinstance(factory, functools.partial) else factory
    if not inspect.isclass(target):
        raise ConfigError(f"rewardbox.sandboxed_environment: {label} is a {type(factory).__name__}: pass the "
                          "environment's class (or functools.partial(TheClass, ...)), whose public methods TRL "
                          "shows the model as tools; the host never makes an instance of it")
    if not callable(getattr(target, "reset", None)):
        raise ConfigError(f"rewardbox.sandboxed_environment: {label}: {target.__name__} has no reset() method, "
                          "which TRL calls at the start of every rollout")
    return target


class _Loop:
    """An event loop on a thread of its own, for the calls TRL makes synchronously (``reset``, a sync
    ``get_reward``)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rewardbox-environment", daemon=True)
        self.thread.start()

    def run(self, coroutine) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class _Episodes:
    """What every proxy of one environment shares: the sandboxes' replicas, the loop for sync calls, the settings."""

    def __init__(self, name: str, spec: RewardSpec, replicas: list, loop: _Loop, max_episodes: int,
                 reuse_process: bool = False):
        self.name, self.spec, self.replicas, self.loop = name, spec, replicas, loop
        self.max_episodes = max_episodes
        self.reuse_process = reuse_process
        self.live: set = set()  # episodes started and not yet ended
        self._rotation = itertools.count()

    def replica(self) -> Replica:
        return self.replicas[next(self._rotation) % len(self.replicas)]

    async def end(self, replica: Replica, episode: str) -> None:
        """Ends ``episode``'s process (the sandbox prepares another). Never raises: a sandbox that cannot be reached
        has ended it anyway, or ends it at the next reset that reaches it."""
        self.live.discard(episode)
        request = pb.ScoreRequest(function=self.name, timeout_s=self.spec.timeout_s, episode_end=episode)
        try:
            await replica.score(request, 10.0)
        except RewardboxError as e:
            log.info("environment %s: ending an episode: %s", self.name, e)

    async def call(self, replica: Replica, episode: str, method: str, args: dict, start: bool = False,
                   end: str = "") -> tuple[Status, Any, str]:
        """(status, the method's result, error text) of one call of ``episode``. Never raises."""
        try:
            arguments = json.dumps({"method": method, "args": args}, allow_nan=False)
        except (TypeError, ValueError) as e:
            return Status.ERROR, None, f"{method}(): an environment's methods take JSON values as arguments: {e}"
        if len(arguments) > call_bytes(self.spec):  # ASCII JSON: characters are bytes
            return Status.ERROR, None, too_much(self.spec, len(arguments), f"{method}()'s arguments are")
        request = pb.ScoreRequest(function=self.name, samples=[pb.Sample(columns_json=arguments)],
                                  timeout_s=self.spec.timeout_s, episode=episode, episode_start=start,
                                  episode_end=end)
        try:
            reply = await replica.score(request, self.spec.timeout_s + HARD_TIMEOUT_MARGIN_S + 10.0)
        except RewardboxError as e:
            return Status.UNAVAILABLE, None, f"the sandbox could not be reached: {e}"
        if len(reply.scores) != 1:
            return Status.INVALID, None, f"the sandbox answered {len(reply.scores)} results for one call"
        outcome = checked(reply.scores[0], tool=True)  # as every sandboxed call's answer is re-checked on the host
        if outcome.status is not Status.OK:
            return outcome.status, None, outcome.error
        try:
            return Status.OK, result_of(str(outcome.value)), ""
        except ValueError as e:
            return Status.INVALID, None, str(e)


class RewardOutcome(NamedTuple):
    """What an episode's last ``get_reward()`` gave: the value TRL got (``default_score`` where it fell back), its
    status, the error (or why the value was refused), and how long the call took."""

    value: Optional[float]
    status: Status
    error: str
    seconds: float


def reward_report(name: str, values: Sequence, environments: Sequence, latency_s: float) -> ScoreReport:
    """The run record's report of a batch of ``get_reward()`` calls (TRL's environment reward ``name``, which gave
    ``values``, one per rollout, from ``environments``): each sandboxed episode's status, error and time where its
    proxy kept them; a value TRL gave for an environment of another class (None) is recorded as it is."""
    statuses: list = []
    errors: list = []
    seconds: list = []
    for value, environment in zip(values, environments):
        outcome = getattr(environment, "reward_outcome", None) if type(environment).__name__ == name else None
        if outcome is None or outcome.value != value:
            statuses.append(Status.OK)
            errors.append(None)
            seconds.append(None)
        else:
            statuses.append(outcome.status)
            errors.append(outcome.error or None)
            seconds.append(outcome.seconds)
    return ScoreReport(name=name, values=list(values), statuses=statuses, errors=errors, latency_s=latency_s,
                       sample_logs=[""] * len(statuses), sample_seconds=seconds, attempts=1)


class EnvironmentProxy:
    """Base of the classes :func:`sandboxed_environment` makes (one per environment class, named after it, with its
    public methods): one instance per instance TRL makes, each the handle of one episode at a time."""

    _episodes: _Episodes

    def __init__(self) -> None:
        self._episode = ""  # the live episode's id ("" before the first reset)
        self._replica: Optional[Replica] = None
        self._gone = ""  # why the episode's process is gone ("" while it lives)
        self.reward_outcome: Optional[RewardOutcome] = None  # what the last get_reward() gave (see _reward)
        # An episode's calls run one at a time in the order they were made (TRL gathers a rollout's calls: started
        # in order, in-process they would run in order); asyncio's lock is fair. One per event loop.
        self._order: dict = {}

    def reset(self, **kwargs: Any) -> Any:
        """Ends this instance's episode, if any, and starts a new one (in a process prepared ahead), calling the
        environment's ``reset(**kwargs)`` there. Returns what it returns. Never raises: an episode that cannot start
        fails its calls, and its ``get_reward`` returns the fallback. With ``reuse_process``, a live episode's
        process takes the ``reset`` itself (the same instance; a fresh process only where it is gone)."""
        episodes = self._episodes
        try:
            json.dumps(kwargs, allow_nan=False)
        except (TypeError, ValueError) as e:
            return self._refuse(f"its episode could not start: reset() takes JSON values as arguments ({e})")
        if episodes.reuse_process and self._episode and not self._gone and self._replica is not None:
            status, value, error = episodes.loop.run(
                episodes.call(self._replica, self._episode, "reset", kwargs))
            if status is Status.OK:
                return value
            if status is Status.ERROR:  # reset raised: the process and its instance live on, as in-process
                log.warning("environment %s: reset() failed: %s", episodes.name, error)
                return None
            log.info("environment %s: a kept episode process is gone (%s): reset() starts a fresh one",
                     episodes.name, error)
        previous, self._episode = self._episode, ""
        episodes.live.discard(previous)
        self._gone = ""
        self.reward_outcome = None
        if len(episodes.live) >= episodes.max_episodes:
            self._episode = previous
            return self._refuse(f"more than max_episodes={episodes.max_episodes} episodes of {episodes.name} are "
                                "live at once (TRL keeps one per rollout in flight): raise max_episodes")
        # An instance keeps to one sandbox (its previous episode's end rides on the next start), but for one that
        # cannot be reached: its episodes are gone with it.
        replica = self._replica or episodes.replica()
        why = ""
        for attempt in range(RESET_ATTEMPTS):
            episode = uuid.uuid4().hex
            status, value, error = episodes.loop.run(
                episodes.call(replica, episode, "reset", kwargs, start=True, end=previous))
            if status is not Status.UNAVAILABLE:
                self._episode, self._replica = episode, replica
                episodes.live.add(episode)
                if status is Status.OK:
                    return value
                log.warning("environment %s: reset() failed: %s", episodes.name, self._fail("reset", status, error))
                return None
            why, previous, replica = error, "", episodes.replica()
            time.sleep(0.2 * 2 ** attempt)
        self._gone = f"its episode could not start: {why}"
        log.error("environment %s: %s", episodes.name, self._gone)
        return None

    def _refuse(self, why: str) -> None:
        """A reset that starts no episode: the last one ends all the same, and the instance's calls say ``why``."""
        self._end()
        self._gone = why
        log.error("environment %s: %s", self._episodes.name, why)
        return None

    def _end(self) -> None:
        """Ends the live episode, if any, without starting another (:func:`end_episode`)."""
        episode, self._episode = self._episode, ""
        self._episodes.live.discard(episode)
        if episode and self._replica is not None:
            self._episodes.loop.run(self._episodes.end(self._replica, episode))

    def _fail(self, method: str, status: Status, error: str) -> ToolError:
        """A call that did not return: the method's own exception (its text, as TRL shows it in-process), or an end
        of the episode's process (a timeout, a crash, a memory kill), after which the episode's calls fail."""
        name = self._episodes.name
        if status is Status.ERROR:
            return ToolError(error, f"{name}.{method}", status)
        self._gone = f"its episode ended when {method}() {ended_how(status)} ({error})"
        return ToolError(f"rewardbox: environment {name!r}: {method}() {ended_how(status)}: {error}",
                         f"{name}.{method}", status)

    def _no_episode(self, method: str) -> ToolError:
        """A call with no live episode to go to: none started yet, or it ended (``_gone`` says how)."""
        why = f"{self._gone}; reset() starts a new one" if self._gone else "no episode: reset() starts one"
        return ToolError(f"rewardbox: environment {self._episodes.name!r}: {why}", f"{self._episodes.name}.{method}",
                         Status.CRASH)

    async def _call(self, method: str, args: dict) -> Any:
        if not self._episode or self._gone:
            raise self._no_episode(method)
        assert self._replica is not None  # set with the episode
        loop = asyncio.get_running_loop()
        lock = self._order.get(loop)
        if lock is None:
            self._order = {k: v for k, v in self._order.items() if not k.is_closed()}
            lock = self._order[loop] = asyncio.Lock()
        async with lock:
            if self._gone:  # a call before this one ended the episode
                raise self._no_episode(method)
            status, value, error = await self._episodes.call(self._replica, self._episode, method, args)
        if status is Status.OK:
            return value
        raise self._fail(method, status, error)

    async def _reward(self) -> Optional[float]:
        """``get_reward()``: the episode's reward, or ``default_score`` where it has none (its process is gone, it
        raised, or it returned something other than a finite number or None). What it gave, with its status, error
        and time, stays as :attr:`reward_outcome` for the run record."""
        default = self._episodes.spec.default_score
        started = time.monotonic()
        status, error = Status.OK, ""
        try:
            value = await self._call("get_reward", {})
        except ToolError as e:
            log.warning("environment %s: get_reward fell back to %r: %s", self._episodes.name, default, e)
            value, status, error = default, e.status, str(e)
        else:
            number = None
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                try:
                    number = float(value)  # an int past a float's range raises
                except OverflowError:
                    pass
            if value is None or number is not None and math.isfinite(number):
                value = number
            else:
                log.warning("environment %s: get_reward returned %.200r, not a finite number: %r instead",
                            self._episodes.name, value, default)
                value, status, error = default, Status.INVALID, \
                    f"get_reward returned {value!r:.200}, not a finite number"
        self.reward_outcome = RewardOutcome(value, status, error, time.monotonic() - started)
        return value


def end_episode(instance: EnvironmentProxy) -> None:
    """Ends ``instance``'s live episode without starting another (its process goes; the sandbox prepares a fresh
    one); its next ``reset`` starts a new one. TRL never needs it (each ``reset`` ends the instance's last episode);
    code that makes and drops instances itself calls it, as a dropped instance's episode lives on until the
    sandboxes stop, holding one of ``max_episodes``."""
    instance._end()


def _method(name: str, original: Callable) -> Callable:
    """An async method with ``original``'s name, signature, docstring and type hints that calls it in the episode's
    process."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    async def method(self: EnvironmentProxy, *args: Any, **kwargs: Any) -> Any:
        if args:
            try:
                kwargs = dict(signature.bind_partial(self, *args, **kwargs).arguments)
            except TypeError as e:
                raise TypeError(f"{name}(): {e}") from None
            kwargs.pop(next(iter(signature.parameters)), None)  # self
        started = time.monotonic()
        try:
            result = await self._call(name, kwargs)
        except ToolError as e:
            CALLS.note(name, kwargs, started, e.status, error=str(e))
            raise
        CALLS.note(name, kwargs, started, Status.OK, result=result)
        return result

    return method


def proxy_class(cls: type, episodes: _Episodes) -> type:
    """A class named as ``cls`` with its public functions (TRL's tools: ``inspect.getmembers(cls,
    inspect.isfunction)`` less ``_``-prefixed names, ``reset`` and ``get_reward``) as async methods that run in the
    episode's process, ``reset`` (sync, as TRL calls it) and, where ``cls`` has one, ``get_reward`` (sync or async as
    the original)."""
    namespace: dict[str, Any] = {"_episodes": episodes, "__doc__": cls.__doc__, "__module__": cls.__module__}
    for name, function in inspect.getmembers(cls, inspect.isfunction):
        if not name.startswith("_") and name not in SPECIAL:
            namespace[name] = _method(name, function)
    original_reset = getattr(cls, "reset")
    def reset(self: EnvironmentProxy, *args: Any, **kwargs: Any) -> Any:
        if args:  # TRL passes the row by keyword; another caller's positional arguments are named by the signature
            try:
                kwargs = dict(inspect.signature(original_reset).bind_partial(None, *args, **kwargs).arguments)
            except TypeError as e:
                return self._refuse(f"its episode could not start: reset(): {e}")
            kwargs.pop(next(iter(inspect.signature(original_reset).parameters)), None)  # self
        return EnvironmentProxy.reset(self, **kwargs)

    namespace["reset"] = functools.wraps(original_reset)(reset)
    original_reward = getattr(cls, "get_reward", None)
    if callable(original_reward):
        namespace["get_reward"] = functools.wraps(original_reward)(
            _get_reward_async if inspect.iscoroutinefunction(original_reward) else _get_reward_sync)
    proxy = type(cls.__name__, (EnvironmentProxy,), namespace)
    proxy.__qualname__ = cls.__qualname__
    return proxy


async def _get_reward_async(self: EnvironmentProxy) -> Optional[float]:
    return await self._reward()


def _get_reward_sync(self: EnvironmentProxy) -> Optional[float]:
    return self._episodes.loop.run(self._reward())


@contextlib.contextmanager
def sandboxed_environment(factory: Union[Callable, dict], *, sandbox: Optional[dict] = None, backend=None,
                          max_episodes: int = DEFAULT_MAX_EPISODES, reuse_process: bool = False,
                          **settings: Any) -> Iterator[Union[Callable, dict]]:
    """Runs each episode of the environment ``factory`` makes (what a script passes as
    ``GRPOTrainer(environment_factory=...)``) in a process of its own in a sandbox, and yields a zero-argument factory
    of proxies for TRL (a dict of them for a dict of factories).

    Args:
        factory: the environment's class (or ``functools.partial`` of it), or TRL's dict of them by name.
        sandbox: the config's ``sandbox:`` section; by default the docker backend.
        backend: a backend object to start the sandboxes on instead (it stays the caller's).
        max_episodes: episodes live at once per environment (each holds a process): TRL keeps one instance per
            rollout in flight.
        reuse_process: an instance's next ``reset`` goes to its live process and instance instead of a fresh one
            (for environments that rely on state across episodes, or whose start is costly): what an episode left
            in that process (files, processes, module state, the instance's attributes) reaches the instance's
            next episodes. Other instances stay apart. A process that is gone is replaced at the next ``reset``.
        settings: ``packages``, ``system_packages``, ``timeout_s`` (per call), ``default_score`` (what
            ``get_reward`` gives for an episode whose process is gone), ``memory``, ``network``, ``secrets``,
            ``env``, ``replicas``...: the reward settings but ``style``, ``weight`` and the process settings, which an
            environment fixes (one process per episode).

    Raises:
        ConfigError: a setting is unknown or invalid, or a factory is not a class or cannot be shipped; plus what
        :meth:`RewardSandboxes.start` raises. Nothing is left running then.
    """
    fixed = sorted(set(settings) & set(NOT_FOR_ENVIRONMENTS))
    if fixed:
        raise ConfigError(f"rewardbox.sandboxed_environment: {', '.join(map(repr, fixed))} are fixed for an "
                          "environment (each episode is a process of its own; max_episodes sets how many live at once)")
    _check_settings(settings, "sandboxed_environment(...)")
    factories = factory if isinstance(factory, dict) else {None: factory}
    shipper = Shipper("sandboxed_environment")
    classes: list[tuple] = []
    entries: list[dict] = []
    names: set[str] = set()
    loop = _Loop()
    try:
        with tempfile.TemporaryDirectory(prefix="rewardbox-environments-") as folder:
            for key, made in factories.items():
                label = f"environment_factory{'' if key is None else f'[{key!r}]'} ({where(made)})"
                cls = _environment_class(made, label)
                name = _spec_name(cls.__name__ if key is None else str(key), names)
                shipment = shipper.ship(made, "environment", label, list(settings.get("packages", [])))
                source = Path(folder) / f"{name}.py"
                source.write_text(shipment.source)
                entry = {**_episode_settings(settings, max_episodes), "name": name, "source": str(source),
                         "function": "environment",
                         "packages": shipment.packages if _installs(sandbox, backend) else settings.get("packages", [])}
                _validate(entry, label)
                classes.append((key, cls))
                entries.append(entry)
            config = parse_config({"sandbox": sandbox or {}, "rewards": entries}, Path.cwd(),
                                  Where(file="rewardbox.sandboxed_environment(...)"))
            with RewardSandboxes(config, backend=backend) as sandboxes:
                made_factories = {}
                for (key, cls), spec in zip(classes, config.rewards):
                    episodes = _Episodes(spec.name, spec, sandboxes.replicas[spec.name], loop, max_episodes,
                                         reuse_process)
                    made_factories[key] = proxy_class(cls, episodes)
                yield made_factories[None] if None in made_factories else made_factories
    finally:
        loop.close()


class EnvironmentSpec(RewardSpec):
    """An environment named in a training config (``environment:``): its class (``function``, default ``name``) in
    ``source``, and the reward settings that apply (see :func:`sandboxed_environment`)."""

    max_episodes: int = Field(default=DEFAULT_MAX_EPISODES, gt=0, description="episodes live at once (one process "
                              "each): TRL keeps one instance per rollout in flight")
    reuse_process: bool = Field(default=False, description="an instance's next reset goes to its live process and "
                                "instance (what an episode left there reaches its next episodes), not a fresh one")


class StartedEnvironment:
    """An environment's sandboxes started from a config, the factory TRL takes, and what stops them."""

    def __init__(self, sandboxes: RewardSandboxes, factory: Callable, loop: _Loop):
        self.sandboxes, self.factory, self._loop = sandboxes, factory, loop

    def stop(self) -> None:
        self.sandboxes.stop()
        self._loop.close()


def environment_from_config(config, spec: EnvironmentSpec, backend=None) -> StartedEnvironment:
    """Starts the sandboxes of the environment a training config names; its tools are read from the class's
    syntax in its file (:func:`.tools.class_stub_from_source`: the host never imports the file).

    Raises:
        ConfigError: the class or a method's signature cannot be read; plus what :meth:`RewardSandboxes.start`
        raises. Nothing is left running then.
    """
    from .tools import class_stub_from_source

    cls = class_stub_from_source(config.source_path(spec), spec.function_name)
    if "reset" not in vars(cls):
        raise ConfigError(f"{config.source_path(spec)}: class {cls.__name__} has no reset() method, which TRL calls "
                          "at the start of every rollout")
    reward = RewardSpec.model_validate(
        _episode_settings(spec.model_dump(exclude={"max_episodes", "reuse_process"}, exclude_unset=True),
                          spec.max_episodes))
    sandboxes = RewardSandboxes(config.model_copy(update={"rewards": [reward]}), backend=backend)
    loop = _Loop()
    try:
        sandboxes.start()
    except BaseException:
        loop.close()
        raise
    episodes = _Episodes(reward.name, reward, sandboxes.replicas[reward.name], loop, spec.max_episodes,
                         spec.reuse_process)
    return StartedEnvironment(sandboxes, proxy_class(cls, episodes), loop)

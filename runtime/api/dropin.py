"""``rewardbox.sandboxed``: a TRL script's own ``reward_funcs``, each run in a sandbox, in one line.

    with rewardbox.sandboxed([accuracy_reward, my_reward], packages=["math-verify"]) as reward_funcs:
        GRPOTrainer(..., reward_funcs=reward_funcs).train()

Each callable is shipped by value (:mod:`.shipping`) as a generated reward file, with the reward settings given
(all of a config's reward settings, for every function, or for one through :func:`configure`), and started as
:class:`~rewardbox.RewardSandboxes` would start a config of those files.
"""

from __future__ import annotations

import contextlib
import logging
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

from pydantic import ValidationError

from ..errors import ConfigError
from ..spec import RewardSpec, Where, format_validation_error, parse_config
from .session import RewardSandboxes
from .shipping import Shipper, signature_style, where

log = logging.getLogger("rewardbox")

# Reward settings sandboxed() takes: every field of a config's reward but what it derives from the function.
DERIVED = ("name", "source", "function", "args")
SETTINGS = tuple(f for f in RewardSpec.model_fields if f not in DERIVED)
MERGED = ("packages", "system_packages", "secrets", "env")  # combined with the shared settings, not replacing them


@dataclass(frozen=True)
class Configured:
    """A reward function with settings of its own for :func:`sandboxed` (made by :func:`configure`)."""

    fn: Callable
    settings: dict = field(default_factory=dict)


def configure(fn: Callable, **settings: Any) -> Configured:
    """``fn`` with reward settings of its own, over the ones :func:`sandboxed` gives every function:
    ``sandboxed([accuracy_reward, configure(judge, network=True, secrets=["OPENAI_API_KEY"])])``. ``packages``,
    ``system_packages``, ``secrets`` and ``env`` add to the shared ones; any other setting replaces it."""
    _check_settings(settings, f"configure({getattr(fn, '__name__', type(fn).__name__)}, ...)")
    return Configured(fn, settings)


def _check_settings(settings: dict, call: str) -> None:
    unknown = sorted(set(settings) - set(SETTINGS))
    if unknown:
        derived = [k for k in unknown if k in DERIVED]
        why = (f"{', '.join(derived)} come from the function itself" if derived else
               f"reward settings are {', '.join(SETTINGS)}")
        raise ConfigError(f"rewardbox.{call}: unknown setting {', '.join(map(repr, unknown))} ({why})")


def _merge(shared: dict, own: dict) -> dict:
    merged = {**shared, **own}
    for key in MERGED:
        if key in shared and key in own:
            a, b = shared[key], own[key]
            merged[key] = {**a, **b} if isinstance(a, dict) else list(dict.fromkeys([*a, *b]))
    return merged


def _passes_through(fn: Any) -> bool:
    """A reward model (its id, or a loaded model): TRL scores it itself; it has no code to sandbox."""
    return isinstance(fn, str) or (hasattr(fn, "forward") and hasattr(fn, "parameters"))


def _spec_name(name: str, taken: set) -> str:
    """The reward's name (so its ``__name__`` and TRL's metric names): the function's own, unless another function
    of the list has it too (then ``name_2``...) or it is not a valid reward name (``<lambda>``: ``_lambda_``)."""
    base = re.sub(r"[^A-Za-z0-9_\-]", "_", name) or "reward"
    if not re.match(r"[A-Za-z_]", base):
        base = "_" + base
    candidate, n = base, 2
    while candidate in taken:
        candidate, n = f"{base}_{n}", n + 1
    taken.add(candidate)
    return candidate


def _validate(reward: dict, label: str) -> None:
    """The config's own checks of one reward's settings, naming the function (not a config's rewards[i])."""
    try:
        RewardSpec.model_validate(reward)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, Where(file=f"rewardbox.sandboxed: {label}"))) from None


def _installs(sandbox: Optional[dict], backend) -> bool:
    """Whether the sandboxes install packages (the local backend runs the host's Python, which has them all)."""
    name = backend.name if backend is not None else (sandbox or {}).get("backend")
    return name != "local"


class SandboxedFuncs(list):
    """The callables :func:`sandboxed` yields, in ``reward_funcs`` order (a plain list for TRL), with the running
    sandboxes as ``.sandboxes`` (for :class:`~rewardbox.trainer.callbacks.RunRecordCallback`)."""

    sandboxes: RewardSandboxes


@contextlib.contextmanager
def sandboxed(funcs: Sequence[Any], *, sandbox: Optional[dict] = None, backend=None,
              **settings: Any) -> Iterator[SandboxedFuncs]:
    """Runs each of ``funcs`` (what a script passes as ``GRPOTrainer(reward_funcs=...)``) in a sandbox, and yields
    TRL reward callables in the same order with the same ``__name__`` (TRL's metric names do not change).

    Args:
        funcs: functions, callable objects, closures a factory made, ``trl.rewards`` functions, each optionally
            wrapped in :func:`configure`; reward models (a model id or a loaded model) pass through unchanged.
        sandbox: the config's ``sandbox:`` section (backend, docker settings...); by default the docker backend.
        backend: a backend object to start the sandboxes on instead (it stays the caller's).
        settings: reward settings for every function (``packages``, ``timeout_s``, ``retries``, ``default_score``,
            ``isolation``, ``network``, ``secrets``, ``style``...: the config's reward keys). ``style`` defaults to
            ``sample`` for ``fn(prompt, completion, example)`` and to TRL's ``batch`` for anything else.

    Raises:
        ConfigError: a setting is unknown or invalid, or a function cannot be shipped (naming it and why); plus
        what :meth:`RewardSandboxes.start` raises. Nothing is left running then.
    """
    _check_settings(settings, "sandboxed(...)")
    shipper = Shipper()
    rewards, slots = [], []
    names: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="rewardbox-sandboxed-") as folder:
        for i, item in enumerate(funcs):
            fn, own = (item.fn, item.settings) if isinstance(item, Configured) else (item, {})
            if _passes_through(fn):
                slots.append(fn)
                continue
            if not callable(fn):
                raise ConfigError(f"rewardbox.sandboxed: reward_funcs[{i}] is a {type(fn).__name__}, not a callable "
                                  "(nor a reward model id)")
            title = getattr(fn, "__name__", None) or type(fn).__name__
            label = f"reward_funcs[{i}] {title} ({where(fn)})"
            merged = _merge(settings, own)
            merged.setdefault("style", signature_style(fn))
            name = _spec_name(title, names)
            shipment = shipper.ship(fn, "reward", label, list(merged.get("packages", [])))
            for requirement, what in shipment.inferred.items():
                log.info("rewardbox.sandboxed: %s refers to %s: its sandbox gets %s (the host's version)", label,
                         what, requirement)
            source = Path(folder) / f"{name}.py"
            source.write_text(shipment.source)
            _validate({**merged, "name": name, "source": str(source)}, label)
            rewards.append({**merged, "name": name, "source": str(source), "function": "reward",
                            "packages": shipment.packages if _installs(sandbox, backend) else merged.get("packages", [])})
            slots.append(len(rewards) - 1)
        config = parse_config({"sandbox": sandbox or {}, "rewards": rewards}, Path.cwd(),
                              Where(file="rewardbox.sandboxed(...)"))
        with RewardSandboxes(config, backend=backend) as sandboxes:
            out = SandboxedFuncs()
            out.extend(sandboxes.rewards[entry] if isinstance(entry, int) else entry for entry in slots)
            out.sandboxes = sandboxes
            yield out

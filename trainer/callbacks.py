"""Trainer callbacks: the run record (record.sqlite, for ``rewardbox report``), what each reward printed
(reward_logs.jsonl), the reward plot (rewards.png), and hot reloading of edited reward files between steps."""

from __future__ import annotations

import functools
import inspect
import json
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

from transformers import TrainerCallback

from ..api.session import RewardSandboxes
from ..errors import RewardboxError, RewardLoadError
from ..report.record import FILENAME as RECORD_FILENAME
from ..report.record import RunRecorder, file_digest
from ..scoring.client import ScoreReport
from ..wire import Status

log = logging.getLogger("rewardbox")

class RewardLog:
    """Appends one JSON line per scored batch and per reward event to ``reward_logs.jsonl``."""

    def __init__(self, path: Path):
        self.path = path
        self._lock = threading.Lock()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("")

    def write(self, record: dict) -> None:
        line = json.dumps({"time": round(time.time(), 3), **record}) + "\n"
        with self._lock, open(self.path, "a") as f:
            f.write(line)

    def listener(self, report: ScoreReport, state) -> None:
        scored = [v for v in report.values if v is not None]
        self.write({
            "step": int(state.global_step) if state is not None else None,
            "reward": report.name,
            "samples": len(report.values),
            "mean": sum(scored) / len(scored) if scored else None,
            "statuses": {s.value: report.count(s) for s in Status if report.count(s)},
            "latency_s": round(report.latency_s, 4),
            "attempts": report.attempts,
            "workers_replaced": report.workers_replaced,
            "logs": report.logs,
        })


def plot_rewards(log_history: list[dict], names: list[str], path: Path) -> Optional[Path]:
    """Writes total and per-function mean reward by step to ``path``; returns it (None before any step)."""
    rows = [h for h in log_history if "reward" in h and "step" in h]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    steps = [h["step"] for h in rows]
    ax.plot(steps, [h["reward"] for h in rows], label="total (weighted)", linewidth=2.2, color="black")
    for name in names:
        key = f"rewards/{name}/mean"
        points = [(h["step"], h[key]) for h in rows if key in h]
        if points:
            ax.plot(*zip(*points), label=name, alpha=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward")
    ax.set_title("GRPO rewards (rewardbox)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class RunRecordCallback(TrainerCallback):
    """Writes the run record (:mod:`rewardbox.report.record`) of a ``GRPOTrainer`` whose rewards are ``sandboxes``'s:
    ``GRPOTrainer(..., reward_funcs=sandboxes.rewards, callbacks=[RunRecordCallback(sandboxes)])``. The file is
    ``record.sqlite`` in the trainer's ``output_dir`` unless ``path`` says otherwise; open it with
    ``rewardbox report OUTPUT_DIR``."""

    def __init__(self, sandboxes: RewardSandboxes, path: Optional[Path] = None):
        self.sandboxes = sandboxes
        self.path = path
        self.environment_rewards: list = []  # (name, weight) of the rewards TRL added for environments
        self.recorder: Optional[RunRecorder] = None
        self._make = None  # other ranks open the record at their first batch (see on_train_begin)
        self._versions: list = []  # reloads seen before the record was open

    def on_train_begin(self, args, state, control, processing_class=None, **kwargs):
        if self.recorder is not None or self._make is not None:
            return
        rewards = self.sandboxes.rewards
        weights = list(args.reward_weights) if getattr(args, "reward_weights", None) else [1.0] * len(rewards)
        config = self.sandboxes.config
        versions = {r.name: file_digest(config.source_path(r)) for r in config.rewards}
        path = Path(self.path or Path(args.output_dir) / RECORD_FILENAME)
        if state.is_world_process_zero and state.global_step == 0:
            set_aside(path)  # a new run: an earlier run's record in this directory is kept beside, not mixed in

        def make() -> RunRecorder:
            return RunRecorder(path, [(r.name, w) for r, w in zip(rewards, weights)] + self.environment_rewards,
                               num_generations=getattr(args, "num_generations", 1) or 1,
                               rank=getattr(args, "process_index", 0), tokenizer=processing_class, versions=versions)

        if state.is_world_process_zero:
            self.recorder = make()
        else:
            # Opened at the first batch: by then the main process has started training (generation gathers
            # across ranks), so it has set an earlier record aside before this rank writes.
            self._make = make
        for reward in rewards:
            reward.recorders.append(self._observe)

    def record_environment_rewards(self, trainer: Any, first: int) -> None:
        """Records the rewards TRL added to ``trainer`` for environments that own one (``get_reward``, after the
        ``first`` reward functions, which are the sandboxes' own): each is wrapped, before training starts, so that
        the values TRL gets, with each sandboxed episode's status, error and time, reach the record as a reward's
        scores of their own (weight as TRL gives it)."""
        from ..api.environments import reward_report

        for j in range(first, len(trainer.reward_funcs)):
            name, original = trainer.reward_func_names[j], trainer.reward_funcs[j]
            self.environment_rewards.append((name, float(trainer.reward_weights[j])))

            def observed(values, started: float, kwargs: dict, name: str = name) -> None:
                try:
                    report = reward_report(name, values, kwargs.get("environments") or [],
                                           time.monotonic() - started)
                    self._observe(name, report, kwargs.get("trainer_state"), kwargs["prompts"],
                                  kwargs["completions"], kwargs, kwargs.get("completion_ids"))
                except Exception:  # noqa: BLE001 - the record must never stop training
                    log.exception("environment reward %s: the run record failed", name)

            trainer.reward_funcs[j] = _observing(original, observed)

    def _observe(self, *args) -> None:
        if self.recorder is None:
            if self._make is None:
                return
            self.recorder, self._make = self._make(), None
            for version in self._versions:
                self.recorder.new_version(*version)
        self.recorder.observe(*args)

    def new_version(self, name: str, digest: str, step: int) -> None:
        """A reward's edited file was loaded at ``step`` (from RewardReloadCallback)."""
        if self.recorder is not None:
            self.recorder.new_version(name, digest, step)
        else:
            self._versions.append((name, digest, step))

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        """Writes what is queued and closes the record (idempotent)."""
        for reward in self.sandboxes.rewards:
            if self._observe in reward.recorders:
                reward.recorders.remove(self._observe)
        self._make = None
        if self.recorder is not None:
            self.recorder.close()
            self.recorder = None


def _observing(original: Callable, observed: Callable) -> Callable:
    """``original`` (a reward function TRL calls with keywords only), sync or async as it is, calling
    ``observed(values, started, kwargs)`` with what it returned."""
    if inspect.iscoroutinefunction(original):
        async def recorded_async(**kwargs: Any) -> Any:
            started = time.monotonic()
            values = await original(**kwargs)
            observed(values, started, kwargs)
            return values

        return functools.wraps(original)(recorded_async)

    def recorded(**kwargs: Any) -> Any:
        started = time.monotonic()
        values = original(**kwargs)
        observed(values, started, kwargs)
        return values

    return functools.wraps(original)(recorded)


def set_aside(path: Path) -> Optional[Path]:
    """Renames a record (and its WAL files) to ``record.<time it was last written>.sqlite``; returns the new name."""
    if not path.exists():
        return None
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
    target = path.with_name(f"{path.stem}.{stamp}{path.suffix}")
    for suffix in ("", "-wal", "-shm"):
        old = path.with_name(path.name + suffix)
        if old.exists():
            old.rename(target.with_name(target.name + suffix))
    log.info("an earlier run's record is kept as %s", target)
    return target


class RewardPlotCallback(TrainerCallback):
    def __init__(self, path: Path, names: list[str]):
        self.path, self.names = path, names

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_rewards(state.log_history, self.names, self.path)

    def on_train_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            plot_rewards(state.log_history, self.names, self.path)


def _mtime(path: Path) -> Optional[int]:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return None


class RewardReloadCallback(TrainerCallback):
    """Before each step, reloads reward files that changed on disk into their running sandboxes.

    A file that no longer loads keeps the previous version serving; both outcomes are logged with the step.
    """

    def __init__(self, sandboxes: RewardSandboxes, reward_log: Optional[RewardLog] = None, on_reload=None):
        self.sandboxes = sandboxes
        self.reward_log = reward_log
        self.on_reload = on_reload  # called with (name, new digest, step) after a reload
        self._paths = {r.name: sandboxes.config.source_path(r) for r in sandboxes.config.rewards}
        self._seen = {name: (_mtime(path), file_digest(path)) for name, path in self._paths.items()}

    def check(self, step: int) -> list[str]:
        """Reloads what changed; returns the names reloaded. Only a file whose mtime moved is read."""
        reloaded = []
        for name, (mtime, digest) in list(self._seen.items()):
            path = self._paths[name]
            new_mtime = _mtime(path)
            if new_mtime == mtime:
                continue
            new_digest = file_digest(path)
            if new_digest is None:
                continue
            if new_digest == digest:
                self._seen[name] = (new_mtime, new_digest)
                continue
            try:
                self.sandboxes.reload(name)
            except RewardLoadError as e:
                self._seen[name] = (new_mtime, new_digest)
                log.error("reward %s changed at step %d but does not load; the previous version keeps running:\n%s",
                          name, step, e)
                self._event(step, name, "reload_failed", str(e))
                continue
            except RewardboxError as e:  # the sandbox is down right now: keep the change pending, try next step
                log.warning("reward %s changed at step %d but its sandbox could not take it now (%s); "
                            "trying again at the next step", name, step, e)
                continue
            self._seen[name] = (new_mtime, new_digest)
            log.warning("reward %s reloaded from its edited file at step %d", name, step)
            self._event(step, name, "reloaded", new_digest[:12])
            if self.on_reload is not None:
                self.on_reload(name, new_digest, step)
            reloaded.append(name)
        return reloaded

    def _event(self, step: int, name: str, event: str, detail: str) -> None:
        if self.reward_log is not None:
            self.reward_log.write({"step": step, "reward": name, "event": event, "detail": detail})

    def on_step_begin(self, args, state, control, **kwargs):
        self.check(state.global_step)

"""Code that runs inside a worker process of the sandbox: loads one reward module and calls it.

A worker holds exactly one function version (set by :func:`init_worker`, the pool's initializer) and imports its
module once, on first use. Each task scores a *chunk* of samples in one go: soft per-sample timeouts come from
``SIGALRM`` (sync code) or ``asyncio.wait`` (async code); anything that escapes them (a crash, a hang in C code)
is handled by the server, which kills the worker and re-runs the chunk one sample per task. What crosses to and
from the server is one of the typed records of :mod:`rewardbox.sandbox.records`.

Only the standard library (and the standard-library-only parts of rewardbox.wire) is imported here: this module is
preloaded into the fork server.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import io
import json
import linecache
import math
import numbers
import os
import signal
import sys
import traceback
import types
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..wire import Status, TrainerState
from .records import ChunkResult, FunctionInfo, Outcome, SampleBatch, WorkerConfig

# Optional keywords a reward function may declare to receive.
OPTIONAL_KEYWORDS = ("trainer_state", "prompt_messages", "completion_messages")


class LoadError(Exception):
    """A reward module or function cannot be used; the message names the file, line and fix."""


class _SampleTimeout(BaseException):
    """Raised by SIGALRM inside the user's code; a BaseException so that ``except Exception`` cannot eat it."""


@dataclass(frozen=True)
class _Loaded:
    """The function a worker serves, with what its signature accepts."""

    fn: Callable
    info: FunctionInfo


_CONFIG: Optional[WorkerConfig] = None
_LOADED: Optional[_Loaded] = None
_LOAD_ERROR: Optional[LoadError] = None


def init_worker(config: WorkerConfig) -> None:
    """Pool initializer: imports the reward module in every worker before it takes a task, so that a slow import
    never counts against a call's timeout. Never raises: an import error is kept and reported on use."""
    global _CONFIG
    _CONFIG = config
    # A process group of our own lets the server kill whatever this worker forked once the worker is gone.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if _CONFIG.registry_dir:
        with contextlib.suppress(OSError):
            open(os.path.join(_CONFIG.registry_dir, str(os.getpid())), "w").close()
    with contextlib.suppress(LoadError):
        _loaded()


def _on_alarm(signum, frame):
    raise _SampleTimeout()


def _user_line(exc: BaseException, filename: str) -> str:
    """The innermost line of the user's file in exc's traceback, as ``file:line``."""
    line = getattr(exc, "lineno", None) if isinstance(exc, SyntaxError) else None
    for frame in traceback.extract_tb(exc.__traceback__):
        if frame.filename == filename:
            line = frame.lineno
    return f"{filename}:{line}" if line else filename


def load_module(config: WorkerConfig) -> types.ModuleType:
    """Imports the reward's source text as a module.

    Raises:
        LoadError: syntax error, or an exception while importing; the message names file and line.
    """
    modname = f"rewardbox_user_{config.name}"
    # Registering the source lets tracebacks show the user's lines although no file exists in the sandbox.
    linecache.cache[config.filename] = (len(config.source), None, config.source.splitlines(True), config.filename)
    module = types.ModuleType(modname)
    module.__file__ = config.filename
    sys.modules[modname] = module
    try:
        code = compile(config.source, config.filename, "exec")
        exec(code, module.__dict__)
    except SyntaxError as e:
        raise LoadError(f"{config.filename}:{e.lineno}: SyntaxError: {e.msg}") from None
    except ModuleNotFoundError as e:
        if os.environ.get("REWARDBOX_BACKEND") == "local":
            fix = f"The local backend installs no packages: install it into {sys.executable}'s environment."
        else:
            fix = f"Add the package that provides it to `packages` of reward {config.name!r}."
        raise LoadError(
            f"{_user_line(e, config.filename)}: ModuleNotFoundError: No module named {e.name!r}. {fix}"
        ) from None
    except BaseException as e:
        raise LoadError(f"{_user_line(e, config.filename)}: {type(e).__name__} while importing: {e}") from None
    return module


def _is_async(fn: Callable) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


def resolve_function(config: WorkerConfig, module: types.ModuleType) -> _Loaded:
    """Finds the function and checks its signature against its style.

    Raises:
        LoadError: missing attribute, not callable, or a signature that does not fit the style.
    """
    fn = getattr(module, config.function, None)
    if fn is None:
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise LoadError(
            f"{config.filename}: no function {config.function!r} (reward {config.name!r}). "
            f"Callables defined there: {', '.join(defined) or 'none'}; set `function:` to one of them."
        )
    if not callable(fn):
        raise LoadError(f"{config.filename}: {config.function!r} is a {type(fn).__name__}, not a function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise LoadError(f"{config.filename}: cannot read the signature of {config.function!r}: {e}") from None
    params = sig.parameters.values()
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    line = getattr(getattr(fn, "__code__", None), "co_firstlineno", None)
    where = f"{config.filename}:{line}" if line else config.filename
    if config.style == "sample":
        try:
            sig.bind(None, None, None)
        except TypeError as e:
            raise LoadError(
                f"{where}: {config.function}{sig} does not fit style 'sample' ({e}). Sample-style rewards are "
                "called as fn(prompt, completion, example, **kw); for TRL's fn(prompts, completions, **kwargs) "
                "set `style: batch`."
            ) from None
    else:
        if "completions" not in named and not var_kw:
            raise LoadError(
                f"{where}: {config.function}{sig} does not fit style 'batch': it must accept `completions` "
                "(and usually `prompts` and **kwargs). For fn(prompt, completion, example) set `style: sample`."
            )
    accepted = tuple(k for k in OPTIONAL_KEYWORDS if k in named or var_kw)
    return _Loaded(fn, FunctionInfo(_is_async(fn), accepted, var_kw, f"{config.function}{sig}"))


def _loaded() -> _Loaded:
    """The loaded function (imported once per worker). Raises the LoadError of a failed import, every time."""
    global _LOADED, _LOAD_ERROR
    if _LOADED is None:
        if _LOAD_ERROR is not None:
            raise _LOAD_ERROR
        assert _CONFIG is not None, "init_worker was not called"
        try:
            _LOADED = resolve_function(_CONFIG, load_module(_CONFIG))
        except LoadError as e:
            _LOAD_ERROR = e
            raise
    return _LOADED


def describe_task() -> FunctionInfo:
    """Describes the function this worker loaded. Raises LoadError when it cannot be used."""
    return _loaded().info


class _BoundedWriter(io.TextIOBase):
    """A text sink that keeps the first ``limit`` characters and counts the rest."""

    def __init__(self, limit: int):
        self.limit, self.parts, self.size, self.dropped = limit, [], 0, 0

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        room = self.limit - self.size
        if room > 0:
            self.parts.append(s[:room])
            self.size += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def text(self) -> str:
        return "".join(self.parts)


def _check(value: Any) -> Outcome:
    if value is None:
        return Outcome.ok(None)
    if isinstance(value, numbers.Real):  # int, bool (1.0/0.0, as TRL takes them), numpy scalars
        f = float(value)
        if math.isfinite(f):
            return Outcome.ok(f)
        return Outcome.failed(Status.INVALID, f"returned {f}; expected a finite float or None")
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return Outcome.failed(Status.INVALID, f"returned {type(value).__name__} {shown}; expected a finite float or None")


def _error(exc: BaseException) -> Outcome:
    if isinstance(exc, SystemExit):
        return Outcome.failed(Status.ERROR, f"SystemExit({exc.code!r}) raised by the reward function")
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return Outcome.failed(Status.ERROR, text[-4000:])


def _timeout(timeout_s: float) -> Outcome:
    return Outcome.failed(Status.TIMEOUT, f"exceeded timeout_s={timeout_s:g}")


def _messages(text: str) -> Any:
    return json.loads(text) if text else None


def _sample_call(batch: SampleBatch, i: int, state: Optional[TrainerState]):
    loaded = _loaded()
    accepted = loaded.info.accepted_keywords
    kw = {}
    if "trainer_state" in accepted:
        kw["trainer_state"] = state
    if "prompt_messages" in accepted:
        kw["prompt_messages"] = _messages(batch.prompt_messages_json[i])
    if "completion_messages" in accepted:
        kw["completion_messages"] = _messages(batch.completion_messages_json[i])
    return loaded.fn(batch.prompts[i], batch.completions[i], dict(batch.examples[i]), **kw)


def _batch_kwargs(batch: SampleBatch, state: Optional[TrainerState]) -> dict:
    loaded = _loaded()
    kw: dict = {
        "prompts": [_messages(pm) if pm else p for p, pm in zip(batch.prompts, batch.prompt_messages_json)],
        "completions": [_messages(cm) if cm else c for c, cm in zip(batch.completions, batch.completion_messages_json)],
    }
    for column in batch.examples[0] if len(batch) else ():
        kw[column] = [example.get(column, "") for example in batch.examples]
    if "trainer_state" in loaded.info.accepted_keywords:
        kw["trainer_state"] = state
    if not loaded.info.accepts_var_keywords:
        params = inspect.signature(loaded.fn).parameters
        kw = {k: v for k, v in kw.items() if k in params}
    return kw


def _batch_outcomes(result: Any, n: int) -> list:
    if not isinstance(result, (list, tuple)) and not hasattr(result, "tolist"):
        failed = Outcome.failed(Status.INVALID, f"batch reward returned {type(result).__name__}; expected a list "
                                                f"of {n} floats")
        return [failed] * n
    values = list(result.tolist() if hasattr(result, "tolist") else result)
    if len(values) != n:
        return [Outcome.failed(Status.INVALID, f"batch reward returned {len(values)} values for {n} samples")] * n
    return [_check(v) for v in values]


def _run_sync(batch: SampleBatch, timeout_s: float, state: Optional[TrainerState], style: str) -> list:
    def timed(call: Callable[[], Any]) -> tuple:
        try:
            signal.signal(signal.SIGALRM, _on_alarm)  # the user's code may have installed its own
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                return call(), None
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _SampleTimeout:
            return None, _timeout(timeout_s)
        except BaseException as e:  # noqa: BLE001 - user code may raise anything, SystemExit included
            return None, _error(e)

    if style == "batch":
        value, failed = timed(lambda: _loaded().fn(**_batch_kwargs(batch, state)))
        return [failed] * len(batch) if failed else _batch_outcomes(value, len(batch))
    outcomes = []
    for i in range(len(batch)):
        value, failed = timed(lambda: _sample_call(batch, i, state))
        outcomes.append(failed or _check(value))
    return outcomes


async def _await_bounded(coro, timeout_s: float) -> tuple:
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        return None, _timeout(timeout_s)
    try:
        return task.result(), None
    except BaseException as e:  # noqa: BLE001
        return None, _error(e)


async def _run_async(batch: SampleBatch, timeout_s: float, state: Optional[TrainerState], style: str,
                     limit: int) -> list:
    if style == "batch":
        value, failed = await _await_bounded(_loaded().fn(**_batch_kwargs(batch, state)), timeout_s)
        return [failed] * len(batch) if failed else _batch_outcomes(value, len(batch))
    gate = asyncio.Semaphore(limit)

    async def one(i: int) -> Outcome:
        async with gate:
            try:
                coro = _sample_call(batch, i, state)
            except BaseException as e:  # noqa: BLE001
                return _error(e)
            value, failed = await _await_bounded(coro, timeout_s)
            return failed or _check(value)

    return list(await asyncio.gather(*(one(i) for i in range(len(batch)))))


def score_task(batch: SampleBatch, timeout_s: float, trainer_state: Optional[TrainerState]) -> ChunkResult:
    """Scores a chunk of samples in this worker: per sample, in order, its outcome, with what the calls printed
    (bounded)."""
    assert _CONFIG is not None
    sink = _BoundedWriter(_CONFIG.max_log_bytes)
    try:
        is_async = _loaded().info.is_async
    except LoadError as e:  # this worker's own import failed although another's succeeded: report, do not die
        return ChunkResult.of([Outcome.failed(Status.ERROR, str(e))] * len(batch))
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            if is_async:
                outcomes = asyncio.run(
                    _run_async(batch, timeout_s, trainer_state, _CONFIG.style, _CONFIG.concurrency)
                )
            else:
                outcomes = _run_sync(batch, timeout_s, trainer_state, _CONFIG.style)
    finally:
        _kill_leftover_children()
    return ChunkResult.of(outcomes, sink.text(), sink.dropped)


def proc_stat(pid: int) -> Optional[list]:
    """The fields of /proc/<pid>/stat after the command name (state first, then ppid, pgrp, ...); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _kill_leftover_children() -> None:
    """Kills what the user's code forked and left running (it would hold the pids limit), then reaps it."""
    me = os.getpid()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:  # no /proc
        return
    try:
        if not any(open(f"/proc/self/task/{t}/children").read().strip() for t in tasks):
            return
    except OSError:
        pass  # this kernel has no children files (CONFIG_PROC_CHILDREN): look through /proc below
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit() and int(e) != me]
    except OSError:
        return
    for entry in entries:
        fields = proc_stat(int(entry))
        if fields and fields[2] == str(me):  # its process group is this worker's
            with contextlib.suppress(OSError):
                os.kill(int(entry), signal.SIGKILL)
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return

"""Code that runs inside a worker process of the sandbox: loads one reward module and calls it.

A worker holds exactly one function version (set by :func:`init_worker`, the pool's initializer) and imports its
module once, on first use. Each task scores a *chunk* of samples in one go: soft per-sample timeouts come from
``SIGALRM`` (sync code) or ``asyncio.wait`` (async code); anything that escapes them (a crash, a hang in C code)
is handled by the server, which kills the worker and re-runs the chunk one sample per task.

Only the standard library is imported here: this module is preloaded into the fork server.
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

OK, ERROR, TIMEOUT, CRASH, INVALID = "ok", "error", "timeout", "crash", "invalid"
# Optional keywords a reward function may declare to receive.
OPTIONAL_KEYWORDS = ("trainer_state", "prompt_messages", "completion_messages")

# (prompt, completion, example, prompt_messages_json, completion_messages_json)
Item = tuple
# (value or None, status, error text)
Outcome = tuple


class LoadError(Exception):
    """A reward module or function cannot be used; the message names the file, line and fix."""


class _SampleTimeout(BaseException):
    """Raised by SIGALRM inside the user's code; a BaseException so that ``except Exception`` cannot eat it."""


@dataclass(frozen=True)
class TrainerState:
    """What a reward sees of training progress, by attribute (``state.global_step``) or key (``state["epoch"]``)."""

    global_step: int = 0
    max_steps: int = 0
    epoch: float = 0.0

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)


@dataclass(frozen=True)
class _Config:
    name: str
    filename: str
    source: str
    function: str
    style: str  # "sample" | "batch"
    concurrency: int
    max_log_bytes: int
    registry_dir: str


_CONFIG: Optional[_Config] = None
_LOADED: Optional[tuple] = None  # (fn, is_async, accepted keywords, accepts **kwargs, signature text)
_LOAD_ERROR: Optional[LoadError] = None


def init_worker(config: dict) -> None:
    """Pool initializer: imports the reward module in every worker before it takes a task, so that a slow import
    never counts against a call's timeout. Never raises: an import error is kept and reported on use."""
    global _CONFIG
    _CONFIG = _Config(**config)
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


def load_module(config: _Config) -> types.ModuleType:
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


def resolve_function(config: _Config, module: types.ModuleType) -> tuple:
    """Finds the function and checks its signature against its style.

    Returns:
        (fn, is_async, accepted optional keywords, accepts **kwargs, signature text)
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
    accepted = [k for k in OPTIONAL_KEYWORDS if k in named or var_kw]
    return fn, _is_async(fn), accepted, var_kw, f"{config.function}{sig}"


def _loaded() -> tuple:
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


def describe_task() -> dict:
    """Describes the function this worker loaded. Raises LoadError when it cannot be used."""
    _, is_async, accepted, var_kw, signature = _loaded()
    return {"is_async": is_async, "accepted_keywords": accepted, "accepts_var_keywords": var_kw, "signature": signature}


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
        return None, OK, ""
    if isinstance(value, numbers.Real):  # int, bool (1.0/0.0, as TRL takes them), numpy scalars
        f = float(value)
        if math.isfinite(f):
            return f, OK, ""
        return None, INVALID, f"returned {f}; expected a finite float or None"
    shown = repr(value)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return None, INVALID, f"returned {type(value).__name__} {shown}; expected a finite float or None"


def _error(exc: BaseException) -> Outcome:
    if isinstance(exc, SystemExit):
        return None, ERROR, f"SystemExit({exc.code!r}) raised by the reward function"
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return None, ERROR, text[-4000:]


def _messages(text: str) -> Any:
    return json.loads(text) if text else None


def _sample_call(item: Item, state: Optional[TrainerState]):
    fn, _, accepted, _, _ = _loaded()
    prompt, completion, example, pm, cm = item
    kw = {}
    if "trainer_state" in accepted:
        kw["trainer_state"] = state
    if "prompt_messages" in accepted:
        kw["prompt_messages"] = _messages(pm)
    if "completion_messages" in accepted:
        kw["completion_messages"] = _messages(cm)
    return fn(prompt, completion, dict(example), **kw)


def _batch_kwargs(items: list, state: Optional[TrainerState]) -> dict:
    fn, _, accepted, var_kw, _ = _loaded()
    kw: dict = {
        "prompts": [_messages(pm) if pm else p for p, _, _, pm, _ in items],
        "completions": [_messages(cm) if cm else c for _, c, _, _, cm in items],
    }
    for column in items[0][2] if items else ():
        kw[column] = [example.get(column, "") for _, _, example, _, _ in items]
    if "trainer_state" in accepted:
        kw["trainer_state"] = state
    if not var_kw:
        params = inspect.signature(fn).parameters
        kw = {k: v for k, v in kw.items() if k in params}
    return kw


def _batch_outcomes(result: Any, n: int) -> list:
    if not isinstance(result, (list, tuple)) and not hasattr(result, "tolist"):
        return [(None, INVALID, f"batch reward returned {type(result).__name__}; expected a list of {n} floats")] * n
    values = list(result.tolist() if hasattr(result, "tolist") else result)
    if len(values) != n:
        return [(None, INVALID, f"batch reward returned {len(values)} values for {n} samples")] * n
    return [_check(v) for v in values]


def _run_sync(items: list, timeout_s: float, state: Optional[TrainerState], style: str) -> list:
    def timed(call: Callable[[], Any]) -> tuple:
        try:
            signal.signal(signal.SIGALRM, _on_alarm)  # the user's code may have installed its own
            signal.setitimer(signal.ITIMER_REAL, timeout_s)
            try:
                return call(), None
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        except _SampleTimeout:
            return None, (None, TIMEOUT, f"exceeded timeout_s={timeout_s:g}")
        except BaseException as e:  # noqa: BLE001 - user code may raise anything, SystemExit included
            return None, _error(e)

    if style == "batch":
        value, failed = timed(lambda: _loaded()[0](**_batch_kwargs(items, state)))
        return [failed] * len(items) if failed else _batch_outcomes(value, len(items))
    outcomes = []
    for item in items:
        value, failed = timed(lambda: _sample_call(item, state))
        outcomes.append(failed or _check(value))
    return outcomes


async def _await_bounded(coro, timeout_s: float) -> tuple:
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        task.cancel()
        return None, (None, TIMEOUT, f"exceeded timeout_s={timeout_s:g}")
    try:
        return task.result(), None
    except BaseException as e:  # noqa: BLE001
        return None, _error(e)


async def _run_async(items: list, timeout_s: float, state: Optional[TrainerState], style: str, limit: int) -> list:
    if style == "batch":
        value, failed = await _await_bounded(_loaded()[0](**_batch_kwargs(items, state)), timeout_s)
        return [failed] * len(items) if failed else _batch_outcomes(value, len(items))
    gate = asyncio.Semaphore(limit)

    async def one(item: Item) -> Outcome:
        async with gate:
            try:
                coro = _sample_call(item, state)
            except BaseException as e:  # noqa: BLE001
                return _error(e)
            value, failed = await _await_bounded(coro, timeout_s)
            return failed or _check(value)

    return list(await asyncio.gather(*(one(item) for item in items)))


def score_task(items: list, timeout_s: float, state: Optional[dict]) -> tuple:
    """Scores a chunk of samples in this worker.

    Returns:
        (outcomes, logs, dropped): one (value, status, error) per item, what the calls printed (bounded), and how
        many characters of output were dropped.
    """
    assert _CONFIG is not None
    trainer_state = TrainerState(**state) if state is not None else None
    sink = _BoundedWriter(_CONFIG.max_log_bytes)
    try:
        is_async = _loaded()[1]
    except LoadError as e:  # this worker's own import failed although another's succeeded: report, do not die
        return [(None, ERROR, str(e))] * len(items), "", 0
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            if is_async:
                outcomes = asyncio.run(
                    _run_async(items, timeout_s, trainer_state, _CONFIG.style, _CONFIG.concurrency)
                )
            else:
                outcomes = _run_sync(items, timeout_s, trainer_state, _CONFIG.style)
    finally:
        _kill_leftover_children()
    return outcomes, sink.text(), sink.dropped


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

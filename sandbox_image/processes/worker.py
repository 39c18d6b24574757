"""Loading a reward function and calling it: what runs inside a slot process of the sandbox.

A template process imports the reward module once (:func:`load`); slot processes forked from it call the
function on the samples of a request (:func:`score` / :func:`score_async`). Everything after the user's call that
could fail on what the user returned (``float()``, ``repr()``, text that cannot be encoded) is guarded per sample:
it becomes that sample's ``error`` or ``invalid``, never a failure of the request.

Only the standard library (and the standard-library-only parts of rewardbox.wire) is imported here: templates are
forked from a process that never loaded grpc. ``asyncio`` is imported where an async function needs it (its
template preloads it): it loads ssl, which makes every fork of a template that holds it cost three times more.
"""

from __future__ import annotations

import _signal
import contextlib
import contextvars
import functools
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

from ...wire import (BATCH_KEYWORDS, CALL_STYLES, OPTIONAL_KEYWORDS, TRAINER_OBJECTS, Outcome, Status, TrainerState,
                     decode_columns, example_of)
from ..protocol.records import FunctionInfo, SampleBatch, WorkerConfig
from . import cpu_wait

MAX_ERROR_CHARS = 4000
# The sandbox's own uses, bound at import: a reward that replaces signal's functions does not change its timer.
_signal_handler, _setitimer, _getsignal = _signal.signal, _signal.setitimer, _signal.getsignal


class LoadError(Exception):
    """A reward module or function cannot be used; the message names the file, line and fix."""


class _SampleTimeout(BaseException):
    """Raised by SIGALRM inside the user's code; a BaseException so that ``except Exception`` cannot eat it."""


@dataclass(frozen=True)
class Loaded:
    """The function a template serves, with what its signature accepts."""

    fn: Callable
    info: FunctionInfo
    config: WorkerConfig


_extended = [0.0]  # how much later the running sample's timer fired than its timeout_s


def _on_alarm(signum, frame):
    # What the sample's processes waited for a CPU that others held is not charged to it (cpu_wait), within what
    # this process may still add to its request's deadlines.
    later = cpu_wait.own_extension_s()
    if later:
        _extended[0] += later
        _setitimer(signal.ITIMER_REAL, later)
        return
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


def _from_factory(config: WorkerConfig, factory: Callable) -> tuple:
    """Calls a factory with the config's ``args`` once; returns (the reward it made, its name for messages).

    Raises:
        LoadError: the factory raised, or returned something that is not callable (naming file and function).
    """
    args = json.loads(config.args_json)
    call = f"{config.function}(**{args!r})"
    line = getattr(getattr(factory, "__code__", None), "co_firstlineno", None)
    where = f"{config.filename}:{line}" if line else config.filename
    try:
        made = factory(**args)
    except BaseException as e:  # noqa: BLE001 - the factory is user code: any failure is a load error
        raise LoadError(f"{where}: {call} (reward {config.name!r}, `args:` makes {config.function!r} a factory) "
                        f"raised {type(e).__name__}: {e} (at {_user_line(e, config.filename)})") from None
    if not callable(made):
        raise LoadError(f"{where}: {call} returned a {type(made).__name__}, not a callable: with `args:` "
                        f"(reward {config.name!r}) {config.function!r} is a factory that must return the reward "
                        "function; drop `args:` if it is the reward itself")
    return made, f"{config.function}(...)"


def resolve_function(config: WorkerConfig, module: types.ModuleType) -> Loaded:
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
    name = config.function
    if config.args_json:
        fn, name = _from_factory(config, fn)
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as e:
        raise LoadError(f"{config.filename}: cannot read the signature of {config.function!r}: {e}") from None
    params = list(sig.parameters.values())
    var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    line = getattr(getattr(fn, "__code__", None), "co_firstlineno", None)
    where = f"{config.filename}:{line}" if line else config.filename
    if config.style in CALL_STYLES:  # a tool, fn(**arguments), or an environment's factory: any signature will do
        info = FunctionInfo(_is_async(fn), (), var_kw, f"{name}{sig}", ())
        return Loaded(fn, info, config)
    if config.style == "sample":
        try:
            sig.bind(None, None, None)
        except TypeError as e:
            raise LoadError(
                f"{where}: {name}{sig} does not fit style 'sample' ({e}). Sample-style rewards are "
                "called as fn(prompt, completion, example, **kw); for TRL's fn(prompts, completions, **kwargs) "
                "set `style: batch`."
            ) from None
    else:
        if "completions" not in named and not var_kw:
            raise LoadError(
                f"{where}: {name}{sig} does not fit style 'batch': it must accept `completions` "
                "(and usually `prompts` and **kwargs). For fn(prompt, completion, example) set `style: sample`."
            )
    keyword_params = params[3:] if config.style == "sample" else params
    required = [p.name for p in keyword_params if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for name in required:
        if name in TRAINER_OBJECTS:
            raise LoadError(f"{where}: {name}{sig}: parameter {name!r} has no default, but it is the "
                            "trainer's own object, which cannot reach a sandbox. Give it a default "
                            f"({name}=None): the function gets the default there.")
        if config.style == "sample" and name not in OPTIONAL_KEYWORDS:
            raise LoadError(f"{where}: {name}{sig}: parameter {name!r} has no default, and a "
                            "sample-style function gets only prompt, completion, example and the keywords "
                            f"{', '.join(OPTIONAL_KEYWORDS)}. Read columns from `example`, or give it a default.")
    accepted = tuple(k for k in OPTIONAL_KEYWORDS if k in named or var_kw)
    info = FunctionInfo(_is_async(fn), accepted, var_kw, f"{name}{sig}",
                        tuple(name for name in required if name not in BATCH_KEYWORDS))
    return Loaded(fn, info, config)


def load(config: WorkerConfig) -> Loaded:
    """Imports the module and resolves the function. Raises LoadError (naming file and line)."""
    return resolve_function(config, load_module(config))


class _BoundedWriter:
    """A text sink that keeps the first ``limit`` characters and counts the rest (what ``sys.stdout`` writes to:
    :class:`_ToRequestSink`). A plain class: one is made per sample under ``isolation: sample``."""

    __slots__ = ("limit", "parts", "size", "dropped")

    def __init__(self, limit: int):
        self.limit, self.size, self.dropped = limit, 0, 0
        self.parts: list[str] = []

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        room = self.limit - self.size
        if room > 0:
            self.parts.append(s[:room])
            self.size += min(room, len(s))
        self.dropped += max(0, len(s) - max(room, 0))
        return len(s)

    def text(self) -> str:
        return "".join(self.parts)


def _shown(value: Any) -> str:
    try:
        text = repr(value)
    except BaseException:  # noqa: BLE001 - a raising __repr__ is the value's problem, not ours
        text = f"<{type(value).__name__} whose repr() raised>"
    return text if len(text) <= 80 else text[:77] + "..."


def _check(value: Any) -> Outcome:
    """The outcome for what the function returned: a finite float (ints and bools count) or None."""
    if value is None:
        return Outcome(None, Status.OK)
    if type(value) is float and math.isfinite(value):  # the common case, without the ABC check below
        return Outcome(value, Status.OK)
    if isinstance(value, numbers.Real):  # int, bool (1.0/0.0, as TRL takes them), numpy scalars
        try:
            f = float(value)
        except BaseException as e:  # noqa: BLE001 - a raising __float__
            return Outcome.failed(Status.INVALID, f"returned {type(value).__name__} whose float() raised "
                                                  f"{type(e).__name__}")
        if isinstance(f, float) and math.isfinite(f):
            return Outcome(f, Status.OK)
        return Outcome.failed(Status.INVALID, f"returned {_shown(f)}; expected a finite float or None")
    return Outcome.failed(Status.INVALID,
                          f"returned {type(value).__name__} {_shown(value)}; expected a finite float or None")


def _error(exc: BaseException, tool: bool = False) -> Outcome:
    """A reward's exception: its traceback (the end of it). A tool's (``tool``): ``str(e)`` alone, the text TRL shows
    the model as ``{"error": str(e)}`` in-process, so the model sees the same text sandboxed."""
    try:
        if isinstance(exc, SystemExit):
            return Outcome.failed(Status.ERROR, f"SystemExit({_shown(exc.code)}) raised by the "
                                                f"{'tool' if tool else 'reward function'}")
        if tool:
            return Outcome.failed(Status.ERROR, str(exc)[:MAX_ERROR_CHARS])
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except BaseException:  # noqa: BLE001 - an exception whose str() or traceback raises
        text = f"{type(exc).__name__} (its message could not be formatted)"
    return Outcome.failed(Status.ERROR, text[-MAX_ERROR_CHARS:])


def _same(a: Any, b: Any) -> bool:
    """Whether ``b`` (``a`` through JSON and back) is ``a`` exactly: same types all the way down (a tuple comes back
    a list, an int key a str, True stays True but 1.0 == 1 would not do)."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:  # JSON's keys are str: a key of another type (a str subclass too) is not carried exactly
        return all(type(k) is str for k in a) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if type(a) is list:
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def tool_result(value: Any) -> Outcome:
    """What a tool returned, as the text a one-sample answer carries (:mod:`..protocol.codec`, has value 2): ``"j"`` and
    its JSON where JSON gives back exactly this value (the host returns the value itself), else ``"s"`` and its
    ``str()`` (the host returns that text: what TRL puts in the conversation, ``str(result)``, is the same)."""
    from ..protocol.codec import MAX_RESULT_BYTES
    # ASCII JSON (ensure_ascii) either way: a lone surrogate or any other character comes back exactly, where UTF-8
    # would replace it.
    text = None
    try:
        encoded = json.dumps(value, allow_nan=False, separators=(",", ":"))
        if _same(value, json.loads(encoded)):
            text = "j" + encoded
    except (TypeError, ValueError, RecursionError):  # not JSON's, or NaN, or nested too deep
        pass
    if text is None:
        shown = str(value)
        if type(shown) is not str:  # a __str__ that returns a str subclass: its plain text
            shown = str.__str__(shown)
        text = "s" + json.dumps(shown)
    size = len(text)
    if size > MAX_RESULT_BYTES:
        return Outcome.failed(Status.INVALID, f"its result takes {size} bytes (as JSON, or its str()), over the "
                                              f"{MAX_RESULT_BYTES >> 10} KiB a tool's result may have in a sandbox")
    return Outcome(text, Status.OK)  # a tool's result travels as the value (:mod:`..protocol.codec`)


def _timeout(timeout_s: float) -> Outcome:
    if _extended[0]:
        return Outcome.failed(Status.TIMEOUT, f"exceeded timeout_s={timeout_s:g} ({_extended[0]:.2f} s after it, as "
                                              "long as it waited for a CPU that others held)")
    return Outcome.failed(Status.TIMEOUT, f"exceeded timeout_s={timeout_s:g}")


def _guarded(make: Callable[[], Outcome]) -> Outcome:
    """Runs post-call processing; whatever it raises is the sample's error."""
    try:
        return make()
    except BaseException as e:  # noqa: BLE001
        return _error(e)


def _outcome(loaded: Loaded, value: Any) -> Outcome:
    """What a sample's call returned, checked: a reward's score, or a tool's result (whose ``str()`` may raise:
    its text, as a tool's own error)."""
    if loaded.config.style in CALL_STYLES:
        try:
            return tool_result(value)
        except BaseException as e:  # noqa: BLE001 - the value's own code raised
            return _error(e, tool=True)
    return _guarded(lambda: _check(value))


def _messages(text: str) -> Any:
    return json.loads(text) if text else None


_EPISODE: list = []  # style environment: the one instance this process holds (a slot process serves one episode)
_EPISODE_LOOP: list = []  # and the event loop its async methods run on, kept across its calls


def drop_episode() -> None:
    """Forgets the instance (and event loop) of an episode: a stand-in's, after :func:`.slot.warm_up_call`."""
    _EPISODE.clear()
    while _EPISODE_LOOP:
        _EPISODE_LOOP.pop().close()


def _episode_call(loaded: Loaded, call: dict) -> Any:
    """One call of an episode: ``call`` is {"method": name, "args": {...}} (the host sends only ``reset``,
    ``get_reward`` and the class's public functions). The instance is made by the factory at the episode's first
    call; an async method's coroutine runs to its end on the episode's own event loop (its state stays across calls).
    """
    method = call["method"]
    if not isinstance(method, str) or method.startswith("_"):
        raise AttributeError(f"{method!r} is not a public method")
    if not _EPISODE:
        _EPISODE.append(loaded.fn())
    value = getattr(_EPISODE[0], method)(**call["args"])
    if inspect.isawaitable(value):
        import asyncio
        if not _EPISODE_LOOP:
            _EPISODE_LOOP.append(asyncio.new_event_loop())
        value = _EPISODE_LOOP[0].run_until_complete(value)
    return value


def _sample_call(loaded: Loaded, batch: SampleBatch, i: int, state: Optional[TrainerState]):
    style = loaded.config.style
    if style == "tool":  # its arguments, as the model wrote them (TRL calls fn(**arguments))
        return loaded.fn(**json.loads(batch.columns_json[i]))
    if style == "environment":
        return _episode_call(loaded, json.loads(batch.columns_json[i]))
    accepted = loaded.info.accepted_keywords
    kw = {}
    if "trainer_state" in accepted:
        kw["trainer_state"] = state
    if "prompt_messages" in accepted:
        kw["prompt_messages"] = _messages(batch.prompt_messages_json[i])
    if "completion_messages" in accepted:
        kw["completion_messages"] = _messages(batch.completion_messages_json[i])
    if "completion_ids" in accepted:
        kw["completion_ids"] = batch.completion_ids[i] if batch.completion_ids is not None else None
    return loaded.fn(batch.prompts[i], batch.completions[i], example_of(batch.columns_json[i]), **kw)


def _batch_kwargs(loaded: Loaded, batch: SampleBatch, state: Optional[TrainerState]) -> dict:
    """TRL's keyword arguments: prompts, completions, completion_ids, every column with the dataset's values (in
    the dataset's order), trainer_state."""
    kw: dict = {
        "prompts": [_messages(pm) if pm else p for p, pm in zip(batch.prompts, batch.prompt_messages_json)],
        "completions": [_messages(cm) if cm else c for c, cm in zip(batch.completions, batch.completion_messages_json)],
        "completion_ids": batch.completion_ids,
    }
    rows = [decode_columns(text) for text in batch.columns_json]
    for column in rows[0] if rows else ():
        kw[column] = [row.get(column) for row in rows]
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
    return [_guarded(functools.partial(_check, v)) for v in values]


def _timed(call: Callable[[], Any], timeout_s: Optional[float], tool: bool = False) -> tuple:
    """(what ``call`` returned, None), or (None, the Outcome of its timeout or exception). ``timeout_s`` None: no
    timer, the caller ends the call at its deadline (a forked sample's slot process: :mod:`.forked`). ``tool``: a
    tool's call (its exception's text: :func:`_error`)."""
    if timeout_s is None:
        try:
            return call(), None
        except BaseException as e:  # noqa: BLE001 - user code may raise anything, SystemExit included
            return None, _error(e, tool)
    try:
        if _getsignal(signal.SIGALRM) is not _on_alarm:  # the user's code may have installed its own
            _signal_handler(signal.SIGALRM, _on_alarm)
        _extended[0] = 0.0
        _setitimer(signal.ITIMER_REAL, timeout_s)
        try:
            return call(), None
        finally:
            _setitimer(signal.ITIMER_REAL, 0)
    except _SampleTimeout:
        return None, _timeout(timeout_s)
    except BaseException as e:  # noqa: BLE001 - user code may raise anything, SystemExit included
        return None, _error(e, tool)


def _run_sync(loaded: Loaded, batch: SampleBatch, timeout_s: Optional[float], state: Optional[TrainerState]) -> list:
    if loaded.config.style == "batch":
        value, failed = _timed(lambda: loaded.fn(**_batch_kwargs(loaded, batch, state)), timeout_s)
        return [failed] * len(batch) if failed else _guarded_batch(value, len(batch))
    tool = loaded.config.style in CALL_STYLES
    outcomes = []
    for i in range(len(batch)):
        value, failed = _timed(lambda: _sample_call(loaded, batch, i, state), timeout_s, tool)
        outcomes.append(failed or _outcome(loaded, value))
    return outcomes


def _guarded_batch(value: Any, n: int) -> list:
    try:
        return _batch_outcomes(value, n)
    except BaseException as e:  # noqa: BLE001 - e.g. a len() or iteration that raises
        return [_error(e)] * n


class _Escaped(Exception):
    """SystemExit or KeyboardInterrupt raised in a coroutine, carried out of its task as an Exception: asyncio would
    re-raise them out of the event loop itself, past the sample's own handling."""

    def __init__(self, exc: BaseException):
        super().__init__()
        self.exc = exc


async def _contained(coro) -> Any:
    try:
        return await coro
    except (SystemExit, KeyboardInterrupt) as e:
        raise _Escaped(e) from None


async def _await_bounded(coro, timeout_s: Optional[float], tool: bool = False) -> tuple:
    import asyncio
    task = asyncio.ensure_future(_contained(coro))
    done, _ = await asyncio.wait({task}, timeout=timeout_s)
    if not done:
        assert timeout_s is not None  # without a timeout, wait returns only once the task is done
        task.cancel()
        return None, _timeout(timeout_s)
    try:
        return task.result(), None
    except _Escaped as e:
        return None, _error(e.exc, tool)
    except BaseException as e:  # noqa: BLE001
        return None, _error(e, tool)


async def _run_async(loaded: Loaded, batch: SampleBatch, timeout_s: Optional[float],
                     state: Optional[TrainerState]) -> list:
    import asyncio
    if loaded.config.style == "batch":
        try:
            coro = loaded.fn(**_batch_kwargs(loaded, batch, state))
        except BaseException as e:  # noqa: BLE001
            return [_error(e)] * len(batch)
        value, failed = await _await_bounded(coro, timeout_s)
        return [failed] * len(batch) if failed else _guarded_batch(value, len(batch))
    gate = asyncio.Semaphore(loaded.config.concurrency)
    tool = loaded.config.style in CALL_STYLES

    async def one(i: int) -> Outcome:
        async with gate:
            try:
                coro = _sample_call(loaded, batch, i, state)
            except BaseException as e:  # noqa: BLE001
                return _error(e, tool)
            value, failed = await _await_bounded(coro, timeout_s, tool)
            return failed or _outcome(loaded, value)

    return list(await asyncio.gather(*(one(i) for i in range(len(batch)))))


# What the function prints goes to the sink of the request it runs for: a context variable, so that requests
# served concurrently on one event loop (isolation: worker, async) each get their own output.
_SINK: contextvars.ContextVar[Optional[_BoundedWriter]] = contextvars.ContextVar("rewardbox_sink", default=None)


class _ToRequestSink(io.TextIOBase):
    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        sink = _SINK.get()
        return sink.write(s) if sink is not None else len(s)


def install_capture() -> None:
    """Routes sys.stdout and sys.stderr to the running request's sink (output outside requests is dropped)."""
    sys.stdout = sys.stderr = _ToRequestSink()


@contextlib.contextmanager
def _captured(limit: int):
    sink = _BoundedWriter(limit)
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


def score_sample(loaded: Loaded, batch: SampleBatch, i: int, timeout_s: Optional[float],
                 state: Optional[TrainerState]) -> tuple:
    """Scores sample ``i`` of a batch with a sync sample-style function. Returns (outcome, logs, dropped
    characters): the same as :func:`score` of that sample alone, without making a one-sample batch. ``timeout_s``
    None: see :func:`_timed`."""
    sink = _BoundedWriter(loaded.config.max_log_bytes)
    token = _SINK.set(sink)
    try:
        value, failed = _timed(lambda: _sample_call(loaded, batch, i, state), timeout_s,
                               loaded.config.style in CALL_STYLES)
        outcome = failed or _outcome(loaded, value)
    finally:
        _SINK.reset(token)
    return outcome, sink.text(), sink.dropped


def score(loaded: Loaded, batch: SampleBatch, timeout_s: Optional[float], state: Optional[TrainerState]) -> tuple:
    """Scores a request's samples with a sync function. Returns (outcomes, logs, dropped characters).
    ``timeout_s`` None: no timer (a forked child, which its slot process ends at the deadline)."""
    with _captured(loaded.config.max_log_bytes) as sink:
        outcomes = _run_sync(loaded, batch, timeout_s, state)
    return outcomes, sink.text(), sink.dropped


async def score_async(loaded: Loaded, batch: SampleBatch, timeout_s: Optional[float],
                      state: Optional[TrainerState]) -> tuple:
    """Scores a request's samples with an async function on the running loop. Returns (outcomes, logs,
    dropped characters). Output is captured per request only where one request runs at a time. ``timeout_s``
    None: no timer."""
    with _captured(loaded.config.max_log_bytes) as sink:
        outcomes = await _run_async(loaded, batch, timeout_s, state)
    return outcomes, sink.text(), sink.dropped

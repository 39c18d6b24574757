"""What a reward's import changes in the interpreter that the sandbox's own code would run or call afterwards.

The template imports the reward once; its slot processes and their children are forks of that state. The sandbox's
own code runs in the template and in every slot process for their whole lives, between samples, with what samples
left for it to clean up (file names, exit statuses, sockets). Reward code that ran there would keep state from one
sample for the next: a hook the import installed (an audit hook, a trace or profile function, a gc callback, a
replaced ``sys.excepthook``) or a function it replaced in a module the sandbox uses (``os.unlink``,
``socket.socket.sendall``, ``builtins.len``...). So, by construction rather than by guessing what a hook does:

- an audit hook cannot be removed once added: while a reward that forks per sample is imported, adding one is
  refused, and the load fails naming the line and the fix (``isolation: worker``);
- signal handlers the import installs are put back as they were (a Python handler is reward code: a sample's
  process, which shares its slot process's uid, could make it run there by signalling it);
- hooks the import registers with ``os.register_at_fork`` (which CPython never unregisters) are held back, not
  registered: they are registered, and its ``after_in_child`` hooks run once, in each process that runs reward
  code, as if that process had been forked from the import's own (as it was);
- everything else the import changed in what existed before it (each module's attributes, the attributes of the
  classes and module-level objects in them, the code and defaults of their functions, the trace and profile
  functions, ``gc.callbacks``, ``sys.meta_path`` and ``sys.path_hooks``) is taken back in the template right after
  the import (:func:`take`), and given back (:func:`give_back`) only in a process that runs reward code: a sample's
  child, or a slot process that scores samples itself. Nothing of it runs in a process that outlives a sample.

Not covered, and recorded in the security log: in-place changes to objects the sandbox's code does not call
(a list's items, a dict's entries), and what C code changes outside Python objects.
"""

from __future__ import annotations

import _signal
import gc
import os
import posix
import signal
import sys
import traceback
import types
from typing import Any, Optional

_MISSING = object()
_IMMUTABLE_TYPE = 1 << 8  # Py_TPFLAGS_IMMUTABLETYPE: a type whose attributes cannot be set (C types)
_FUNCTION_PARTS = ("__code__", "__defaults__", "__kwdefaults__")


class _Watch:
    """Refuses, while armed, every ``sys.addaudithook`` (raising RuntimeError from an audit hook makes CPython skip
    the new hook and return quietly), and remembers where it was called from."""

    def __init__(self) -> None:
        self.armed = False
        self.filename = ""
        self.refused: list[str] = []

    def __call__(self, event: str, args: tuple) -> None:
        if event != "sys.addaudithook" or not self.armed:
            return
        frame, where = sys._getframe(1), ""
        while frame is not None:
            if frame.f_code.co_filename == self.filename:
                where = f"{self.filename}:{frame.f_lineno}"
                break
            frame = frame.f_back
        self.refused.append(where or self.filename)
        raise RuntimeError("rewardbox: no audit hook may be added while the reward is imported")


_watch = _Watch()
_hooked = False
_register_at_fork = os.register_at_fork  # the interpreter's own, bound before any reward is imported
_set_handler, _get_handler = _signal.signal, _signal.getsignal
_held_at_fork: list[dict] = []


def _hold_at_fork(*, before=None, after_in_child=None, after_in_parent=None) -> None:
    """``os.register_at_fork`` while the reward is imported: checked as CPython checks, then held (see above)."""
    hooks = {"before": before, "after_in_child": after_in_child, "after_in_parent": after_in_parent}
    given = {k: v for k, v in hooks.items() if v is not None}
    if not given:
        raise TypeError("At least one argument is required.")
    for name, hook in given.items():
        if not callable(hook):
            raise TypeError(f"'{name}' must be callable, not {type(hook).__name__}")
    _held_at_fork.append(given)


class Effects:
    """What one import changed, as (kind, owner, name, value) for the import's values and for those before it."""

    def __init__(self) -> None:
        self.before: list[tuple] = []
        self.after: list[tuple] = []
        self.trace: Any = None
        self.profile: Any = None
        self.gc_callbacks: list = []
        self.meta_path: Optional[list] = None
        self.path_hooks: Optional[list] = None
        self.at_fork: list[dict] = []
        self.signals: dict = {}  # signal number -> what the import set (a handler, SIG_IGN or SIG_DFL)

    def any(self) -> bool:
        return bool(self.after or self.at_fork or self.signals or self.gc_callbacks or self.meta_path is not None
                    or self.path_hooks is not None or self.trace is not None or self.profile is not None)

    def give_back(self) -> None:
        """In a process about to run reward code: everything the import set, as it set it."""
        _apply(self.after)
        for signum, handler in self.signals.items():
            _set_handler(signum, handler)
        for hooks in self.at_fork:
            _register_at_fork(**hooks)
        for hooks in self.at_fork:
            if "after_in_child" in hooks:
                try:
                    hooks["after_in_child"]()
                except Exception:  # noqa: BLE001 - as CPython does with a failing fork hook: reported, ignored
                    traceback.print_exc()
        if self.meta_path is not None:
            sys.meta_path[:] = self.meta_path
        if self.path_hooks is not None:
            sys.path_hooks[:] = self.path_hooks
        if self.gc_callbacks:
            gc.callbacks[:] = self.gc_callbacks
        if self.profile is not None:
            sys.setprofile(self.profile)
        if self.trace is not None:
            sys.settrace(self.trace)


_taken: Optional[Effects] = None


class _Snapshot:
    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.modules: dict[str, tuple] = {}  # name -> (module, copy of its dict)
        self.objects: dict[int, tuple] = {}  # id -> (kind, object, copy of what it holds)
        self.meta_path = list(sys.meta_path)
        self.path_hooks = list(sys.path_hooks)
        self.gc_callbacks = list(gc.callbacks)
        self.signals = _dispositions()
        for name, module in list(sys.modules.items()):
            if isinstance(module, types.ModuleType):
                contents = dict(vars(module))
                self.modules[name] = (module, contents)
                for value in contents.values():
                    self._object(value, descend=True)

    def _object(self, value: Any, descend: bool) -> None:
        key = id(value)
        if key in self.objects or isinstance(value, types.ModuleType):
            return
        if isinstance(value, type):
            if value.__flags__ & _IMMUTABLE_TYPE:
                return
            contents = dict(vars(value))
            self.objects[key] = ("class", value, contents)
            if descend:
                for member in contents.values():
                    if isinstance(member, types.FunctionType):
                        self._object(member, descend=False)
        elif isinstance(value, types.FunctionType):
            self.objects[key] = ("function", value, tuple(getattr(value, part) for part in _FUNCTION_PARTS))
        else:
            try:
                contents = vars(value)
            except TypeError:
                return
            if isinstance(contents, dict):
                self.objects[key] = ("object", value, dict(contents))

    def changes(self) -> tuple[list, list]:
        """(the values before, the values after) of everything that differs now, as :func:`_apply` takes them."""
        before, after = [], []
        for module, was in self.modules.values():
            _diff(("dict", vars(module)), was, vars(module), before, after)
        for kind, owner, was in self.objects.values():
            if kind == "function":
                now = tuple(getattr(owner, part) for part in _FUNCTION_PARTS)
                for part, old, new in zip(_FUNCTION_PARTS, was, now):
                    if old is not new:
                        before.append(("attribute", owner, part, old))
                        after.append(("attribute", owner, part, new))
            elif kind == "class":
                _diff(("class", owner), was, dict(vars(owner)), before, after)
            else:
                _diff(("dict", vars(owner)), was, vars(owner), before, after)
        return before, after


def _dispositions() -> dict:
    found = {}
    for signum in signal.valid_signals():
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            continue
        try:
            found[signum] = _get_handler(signum)
        except (OSError, ValueError):
            continue
    return found


def _diff(target: tuple, was: dict, now: dict, before: list, after: list) -> None:
    kind, owner = target
    for name in was.keys() | now.keys():
        old, new = was.get(name, _MISSING), now.get(name, _MISSING)
        if old is not new:
            before.append((kind, owner, name, old))
            after.append((kind, owner, name, new))


def _apply(changes: list) -> None:
    for kind, owner, name, value in changes:
        if kind == "dict":
            if value is _MISSING:
                owner.pop(name, None)
            else:
                owner[name] = value
        elif kind == "class":
            if value is _MISSING:
                type.__delattr__(owner, name)
            else:
                type.__setattr__(owner, name, value)
        else:
            setattr(owner, name, value)


def watch(filename: str, refuse_audit_hooks: bool) -> _Snapshot:
    """Before the import: what exists now, and (``refuse_audit_hooks``) the refusal of audit hooks armed."""
    global _hooked
    if refuse_audit_hooks:
        if not _hooked:
            sys.addaudithook(_watch)
            _hooked = True
        _watch.filename, _watch.refused, _watch.armed = filename, [], True
    snapshot = _Snapshot(filename)
    _held_at_fork.clear()
    os.register_at_fork = posix.register_at_fork = _hold_at_fork
    return snapshot


def take(snapshot: _Snapshot) -> str:
    """Right after the import (in the template, before any of its own code runs): everything the import changed in
    what existed before it is put back as it was; :func:`give_back` restores the import's values where reward code
    runs. Returns why the reward cannot be served this way ("" where it can)."""
    global _taken
    _watch.armed = False
    os.register_at_fork = posix.register_at_fork = _register_at_fork
    effects = Effects()
    effects.at_fork = list(_held_at_fork)
    effects.trace, effects.profile = sys.gettrace(), sys.getprofile()
    sys.settrace(None)
    sys.setprofile(None)
    effects.gc_callbacks = list(gc.callbacks)
    gc.callbacks[:] = snapshot.gc_callbacks
    if sys.meta_path != snapshot.meta_path:
        effects.meta_path = list(sys.meta_path)
        sys.meta_path[:] = snapshot.meta_path
    if sys.path_hooks != snapshot.path_hooks:
        effects.path_hooks = list(sys.path_hooks)
        sys.path_hooks[:] = snapshot.path_hooks
    for signum, handler in _dispositions().items():
        was = snapshot.signals.get(signum)
        if handler is not was and handler is not None:
            effects.signals[signum] = handler
            _set_handler(signum, was if was is not None else signal.SIG_DFL)
    effects.before, effects.after = snapshot.changes()
    try:
        _apply(effects.before)
    except (AttributeError, TypeError) as e:
        return (f"{snapshot.filename}: importing it changed what the sandbox's own code uses in a way that cannot be "
                f"taken back ({type(e).__name__}: {e}); use isolation: worker for this reward")
    _taken = effects if effects.any() else None  # most imports change nothing: their samples pay nothing here
    if _watch.refused:
        return (f"{_watch.refused[0]}: importing it adds an audit hook (sys.addaudithook), which CPython never "
                "removes: it would run in the process that starts every sample, with the names of the files samples "
                "leave, and keep what it saw for the samples after them. Add it inside the reward function, or use "
                "isolation: worker for a reward that needs one for its whole life")
    return ""


def give_back() -> None:
    """In a process about to run reward code (a sample's child, or a slot process that scores samples itself):
    what the import set, as it set it. Nothing where :func:`take` never ran (the local backend's own tests)."""
    if _taken is not None:
        _taken.give_back()

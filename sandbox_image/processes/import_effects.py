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
- everything else the import changed in what existed before it (the type and the attributes of each module and
  of each module-level object, each class's metaclass, bases and attributes, the code, defaults and closure cells of
  their functions, the trace and profile functions, ``gc.callbacks``, ``sys.meta_path`` and ``sys.path_hooks``) is
  taken back in the template right after the import (:func:`take`), and given back (:func:`give_back`) only in a
  process that runs reward code: a sample's child, or a slot process that scores samples itself. Nothing of it
  runs in a process that outlives a sample. All of it is read and written through the base types' own
  descriptors, so a class the import swapped in (``os.__class__ = Tracked``) runs nothing while it is taken.

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
        frame: Optional[types.FrameType] = sys._getframe(1)
        where = ""
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


# Read and written through the base types' own descriptors, never through attribute lookup on the object: a class
# the import swapped in (``os.__class__ = Tracked``) could otherwise run reward code, or lie, on each access.
_module_dict = vars(types.ModuleType)["__dict__"].__get__  # vars(): typeshed has ModuleType.__dict__ as a property
_class_dict = type.__dict__["__dict__"].__get__
_class_bases = type.__dict__["__bases__"].__get__
_set_class_of_object = object.__setattr__
_FUNCTION_PARTS = tuple((part, types.FunctionType.__dict__[part]) for part in ("__code__", "__defaults__",
                                                                               "__kwdefaults__"))
_closure = types.FunctionType.__dict__["__closure__"].__get__
_cell_contents = types.CellType.__dict__["cell_contents"]


def _instance_dict(value: Any) -> Optional[dict]:
    """An object's own ``__dict__``, read through the descriptor its type had before the import (this runs after
    the types are put back), or None where it has none."""
    try:
        contents = object.__getattribute__(value, "__dict__")
    except (AttributeError, TypeError):
        return None
    return contents if type(contents) is dict else None


class _Snapshot:
    """What exists before the import: every module in ``sys.modules``, and, one level down, what each holds (its
    classes, with their functions, its functions and its other objects). For each: its type, and what it holds
    (a module's or an object's attributes, a class's attributes and bases, a function's code, defaults and closure
    cells)."""

    def __init__(self, filename: str) -> None:
        self.filename = filename
        self.types: dict[int, tuple] = {}  # id -> (object, its type)
        self.modules: list[tuple] = []  # (module, copy of its dict)
        self.classes: list[tuple] = []  # (class, its bases, copy of its dict)
        self.functions: list[tuple] = []  # (function, its parts, its closure's cells and their contents)
        self.objects: list[tuple] = []  # (object, copy of its dict)
        self.meta_path = list(sys.meta_path)
        self.path_hooks = list(sys.path_hooks)
        self.gc_callbacks = list(gc.callbacks)
        self.signals = _dispositions()
        for module in list(sys.modules.values()):
            if isinstance(module, types.ModuleType) and id(module) not in self.types:
                self.types[id(module)] = (module, type(module))
                contents = dict(_module_dict(module))
                self.modules.append((module, contents))
                for value in contents.values():
                    self._take(value, descend=True)

    def _take(self, value: Any, descend: bool) -> None:
        if id(value) in self.types or isinstance(value, types.ModuleType):
            return
        if isinstance(value, type):
            if value.__flags__ & _IMMUTABLE_TYPE:
                return
            self.types[id(value)] = (value, type(value))
            contents = dict(_class_dict(value))
            self.classes.append((value, _class_bases(value), contents))
            if descend:
                for member in contents.values():
                    if isinstance(member, types.FunctionType):
                        self._take(member, descend=False)
        elif isinstance(value, types.FunctionType):
            self.types[id(value)] = (value, types.FunctionType)
            cells = _closure(value) or ()
            self.functions.append((value, tuple(part.__get__(value) for _, part in _FUNCTION_PARTS),
                                   tuple((cell, _contents(cell)) for cell in cells)))
        else:
            self.types[id(value)] = (value, type(value))
            own = _instance_dict(value)
            if own is not None:
                self.objects.append((value, dict(own)))

    def changes(self) -> tuple[list, list]:
        """(the values before, the values after) of everything that differs now, as :func:`_apply` takes them,
        each stage put back before the next is read: types first (so that nothing after reads through a class the
        import swapped in), then bases, then what each holds."""
        before: list = []
        after: list = []

        def stage(found: list) -> None:
            _apply([old for old, _ in found])
            before.extend(old for old, _ in found)
            after[:0] = [new for _, new in found]  # given back in the reverse order: what each holds, then types

        stage([(("type", owner, None, was), ("type", owner, None, type(owner)))
               for owner, was in self.types.values() if type(owner) is not was])
        stage([(("bases", cls, None, bases), ("bases", cls, None, _class_bases(cls)))
               for cls, bases, _ in self.classes if _class_bases(cls) is not bases])
        found: list = []
        for cls, _, was in self.classes:
            found += _diff("class", cls, was, dict(_class_dict(cls)))
        for module, was in self.modules:
            found += _diff("dict", _module_dict(module), was, _module_dict(module))
        for function, parts, cells in self.functions:
            for (name, descriptor), old in zip(_FUNCTION_PARTS, parts):
                new = descriptor.__get__(function)
                if new is not old:
                    found.append((("part", function, descriptor, old), ("part", function, descriptor, new)))
            for cell, old in cells:
                new = _contents(cell)
                if new is not old:
                    found.append((("cell", cell, None, old), ("cell", cell, None, new)))
        stage(found)
        found = []
        for value, was in self.objects:
            now = _instance_dict(value)
            if now is not None:
                found += _diff("dict", now, was, now)
        stage(found)
        return before, after


def _contents(cell: types.CellType) -> Any:
    try:
        return _cell_contents.__get__(cell)
    except ValueError:  # an empty cell
        return _MISSING


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


def _diff(kind: str, owner: Any, was: dict, now: dict) -> list:
    found = []
    for name in was.keys() | now.keys():
        old, new = was.get(name, _MISSING), now.get(name, _MISSING)
        if old is not new:
            found.append(((kind, owner, name, old), (kind, owner, name, new)))
    return found


def _apply(changes: list) -> None:
    """Each (kind, owner, name, value): sets it, through the base types' own setters (a class the import swapped
    in runs no code of its own here)."""
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
        elif kind == "type":
            if issubclass(type(owner), type):  # isinstance would ask the object for its __class__
                type.__setattr__(owner, "__class__", value)
            else:
                _set_class_of_object(owner, "__class__", value)
        elif kind == "bases":
            type.__setattr__(owner, "__bases__", value)
        elif kind == "part":
            name.__set__(owner, value)
        elif value is _MISSING:  # an emptied closure cell
            _cell_contents.__delete__(owner)
        else:
            _cell_contents.__set__(owner, value)


def _same_items(now: list, was: list) -> bool:
    """By identity: ``==`` would call the items' own ``__eq__`` (reward code, which may say yes)."""
    return len(now) == len(was) and all(a is b for a, b in zip(now, was))


def watch(filename: str, refuse_audit_hooks: bool) -> _Snapshot:
    """Before the import: what exists now, and (``refuse_audit_hooks``) the refusal of audit hooks armed."""
    global _hooked
    if refuse_audit_hooks and not _hooked:
        sys.addaudithook(_watch)
        _hooked = True
    _watch.filename, _watch.refused, _watch.armed = filename, [], False
    _held_at_fork.clear()
    # Before arming: this module's own state is the same before and after (an armed watch, taken as the import's
    # change, was put back armed in the template and disarmed in every child, which then had a change to apply).
    snapshot = _Snapshot(filename)
    _watch.armed = refuse_audit_hooks
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
    if not _same_items(sys.meta_path, snapshot.meta_path):
        effects.meta_path = list(sys.meta_path)
        sys.meta_path[:] = snapshot.meta_path
    if not _same_items(sys.path_hooks, snapshot.path_hooks):
        effects.path_hooks = list(sys.path_hooks)
        sys.path_hooks[:] = snapshot.path_hooks
    for signum, handler in _dispositions().items():
        was = snapshot.signals.get(signum)
        if handler is not was and handler is not None:
            effects.signals[signum] = handler
            _set_handler(signum, was if was is not None else signal.SIG_DFL)
    try:
        effects.before, effects.after = snapshot.changes()
    except (AttributeError, TypeError, ValueError) as e:
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

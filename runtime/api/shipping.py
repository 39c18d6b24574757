"""Shipping a callable of the training process to a sandbox by value: the code behind :func:`rewardbox.sandboxed`.

A reward defined in the training script, a closure a factory made, a function of the user's own modules, or one of
``trl.rewards``: none of them is a file a sandbox can import. So the function is serialized by value with
cloudpickle (its code, defaults, closure cells and the globals it reads) into a generated module, which the sandbox
imports like any reward file.

Trust: code goes host -> sandbox only, the direction in which the host trusts itself (it wrote or chose the code);
the sandbox unpickles what the host made. Nothing is ever unpickled on the host, and nothing a sandbox sends back is
more than the wire's scores and text.

What goes by value and what by reference (the sandbox imports it):

- by value: ``__main__`` (cloudpickle's own rule), modules of no installed distribution (the user's own files),
  distributions installed from a folder (``pip install -e .`` of the user's project: no index has them), and TRL
  (:data:`BY_VALUE`: pure Python, and installing it would pull torch into the sandbox);
- by reference: the standard library, ``rewardbox`` (every sandbox image holds it), and the distributions the
  reward names in ``packages``; any other installed distribution the code refers to is added to ``packages`` at the
  host's version, except the trainer's own stack (:data:`TRAINER_STACK`: gigabytes, and never what a reward should
  need), which is an error naming what refers to it.

The generated module checks the sandbox's Python: cloudpickle carries bytecode, which only the same minor version
runs.
"""

from __future__ import annotations

import base64
import functools
import importlib.metadata
import inspect
import io
import json
import pickle
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import cloudpickle
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from ..errors import ConfigError
from ..spec import is_local_package

BY_VALUE = frozenset({"trl"})  # distributions shipped by value, with the modules of no distribution
TRAINER_STACK = frozenset(canonicalize_name(d) for d in (
    "torch", "transformers", "accelerate", "peft", "deepspeed", "vllm", "datasets", "tensorflow", "jax", "flax",
    "bitsandbytes", "triton", "torchvision", "torchaudio", "flash-attn", "xformers", "liger-kernel"))
ALWAYS_THERE = frozenset({"rewardbox", "cloudpickle", "__main__", "builtins"})
MAX_SOURCE_BYTES = 1 << 20  # a source file shown in a sandbox's tracebacks: larger ones are left out
MAX_ROUNDS = 20
PYTHON = tuple(sys.version_info[:2])  # what the shipped bytecode needs in the sandbox


@dataclass
class Shipment:
    """One callable, ready to be written as a reward file."""

    source: str  # the generated module
    attribute: str  # the reward's name in it
    packages: list[str]  # the reward's packages: the ones named, plus cloudpickle and what the code needs
    inferred: dict[str, str] = field(default_factory=dict)  # requirement -> what refers to it (for the log)


def where(fn: Any) -> str:
    """``file:line`` of a callable's code (a callable object's ``__call__``), else its type's name."""
    target = fn
    while isinstance(target, types.MethodType) or hasattr(target, "__wrapped__"):
        target = getattr(target, "__wrapped__", None) or target.__func__
    code = getattr(target, "__code__", None) or getattr(getattr(type(target), "__call__", None), "__code__", None)
    if code is None:
        return f"a {type(fn).__name__}"
    return f"{code.co_filename}:{code.co_firstlineno}"


def _top(module_name: str) -> str:
    return module_name.split(".", 1)[0]


class _Recorder(cloudpickle.CloudPickler):
    """cloudpickle's pickler, noting every module, class and function it pickles by reference (which the sandbox
    must import) and the file of every code object it pickles by value (shown in the sandbox's tracebacks)."""

    def __init__(self, file) -> None:
        super().__init__(file, protocol=pickle.DEFAULT_PROTOCOL)
        self.by_reference: dict[str, str] = {}  # module -> the first thing of it referred to
        self.files: set[str] = set()

    def reducer_override(self, obj: Any) -> Any:
        result = super().reducer_override(obj)
        if isinstance(obj, types.FunctionType) and result is not NotImplemented:
            self.files.add(obj.__code__.co_filename)
        elif result is NotImplemented:
            if isinstance(obj, types.ModuleType):
                if not cloudpickle.cloudpickle._is_registered_pickle_by_value(obj):
                    self.by_reference.setdefault(obj.__name__, obj.__name__)
            elif isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
                module = getattr(obj, "__module__", None)
                if isinstance(module, str):
                    self.by_reference.setdefault(module, f"{module}.{getattr(obj, '__qualname__', obj)}")
        return result


def _pickle(fn: Any) -> tuple[bytes, _Recorder]:
    buffer = io.BytesIO()
    recorder = _Recorder(buffer)
    recorder.dump(fn)
    return buffer.getvalue(), recorder


@functools.lru_cache(maxsize=None)
def _from_a_folder(distribution: str) -> bool:
    """Whether a distribution was installed from a folder of this machine (``pip install -e .`` of the user's own
    project): no package index has it, so its code goes by value like a module of no distribution."""
    try:
        text = importlib.metadata.distribution(distribution).read_text("direct_url.json")
        if not text:
            return False
        return str(json.loads(text).get("url", "")).startswith("file:")
    except (importlib.metadata.PackageNotFoundError, ValueError, AttributeError):
        return False


def _is_standard(top: str) -> bool:
    return top in sys.stdlib_module_names or top in sys.builtin_module_names or top.startswith("_")


class Shipper:
    """Ships callables; one per :func:`rewardbox.sandboxed` call (it reads the installed distributions once)."""

    def __init__(self, call: str = "sandboxed") -> None:
        self.call = call  # what errors name: rewardbox.sandboxed, rewardbox.sandboxed_tools
        self.distributions = importlib.metadata.packages_distributions()  # top-level module -> distributions

    def _distribution(self, top: str) -> Optional[str]:
        found = self.distributions.get(top)
        return found[0] if found else None

    def _goes_by_value(self, top: str) -> bool:
        if _is_standard(top) or top in ALWAYS_THERE or top not in sys.modules:
            return False
        distribution = self._distribution(top)
        return distribution is None or canonicalize_name(distribution) in BY_VALUE or _from_a_folder(distribution)

    def ship(self, fn: Callable, attribute: str, label: str, packages: list[str]) -> Shipment:
        """Serializes ``fn`` by value into a module whose ``attribute`` is it. ``label`` names it in errors
        (``reward_funcs[2] my_reward (train.py:12)``); ``packages`` are the ones the user named for it.

        Raises:
            ConfigError: it cannot be serialized, or it needs the trainer's own stack in the sandbox.
        """
        registered: set[str] = set()
        try:
            for _ in range(MAX_ROUNDS):
                for top in registered:
                    cloudpickle.register_pickle_by_value(sys.modules[top])
                try:
                    data, recorder = _pickle(fn)
                except Exception as e:  # noqa: BLE001 - whatever cloudpickle or an object's __reduce__ raises
                    raise ConfigError(
                        f"rewardbox.{self.call}: {label} cannot be shipped to a sandbox: {type(e).__name__}: {e}. "
                        "A reward function is copied into its sandbox with everything it refers to (closure cells, "
                        "globals, defaults); an open socket, file, lock, thread or a C object cannot be copied: "
                        "create it inside the function, or put the function in a file and use a config "
                        "(`rewards: [{source: FILE}]`).") from None
                more = {_top(m) for m in recorder.by_reference if self._goes_by_value(_top(m))} - registered
                if not more:
                    break
                registered |= more
        finally:
            for top in registered:
                cloudpickle.unregister_pickle_by_value(sys.modules[top])
        needed, inferred = self._packages(recorder.by_reference, label, packages)
        return Shipment(_module_text(attribute, label, data, recorder.files), attribute, needed, inferred)

    def _packages(self, by_reference: dict, label: str, packages: list[str]) -> tuple[list[str], dict]:
        named = set()
        for p in packages:
            if not is_local_package(p):
                try:
                    named.add(canonicalize_name(Requirement(p).name))
                except InvalidRequirement:
                    pass  # the config's own validation names it
        needed = list(packages)
        inferred: dict[str, str] = {}
        if "cloudpickle" not in named:
            needed.append(f"cloudpickle=={cloudpickle.__version__}")
        for module, what in sorted(by_reference.items()):
            top = _top(module)
            if _is_standard(top) or top in ALWAYS_THERE:
                continue
            distribution = self._distribution(top)
            if distribution is None:
                continue  # not installed here either: the sandbox's import error names it and the fix
            name = canonicalize_name(distribution)
            if name in named:
                continue
            if name in TRAINER_STACK:
                raise ConfigError(
                    f"rewardbox.{self.call}: {label} refers to {what}, of {distribution}, the trainer's own stack, "
                    f"which a sandbox does not install by itself (gigabytes, and rarely what a reward needs): "
                    "compute the reward without it (a tokenizer or model captured from the script is the usual "
                    f"cause: pass what it computes, e.g. completion_ids, instead), or name it in packages=[...] "
                    "to install it there anyway.")
            requirement = f"{distribution}=={importlib.metadata.version(distribution)}"
            named.add(name)
            needed.append(requirement)
            inferred[requirement] = what
        return needed, inferred


def _sources(files: set[str]) -> dict[str, str]:
    """The text of each file whose code went by value, for the sandbox's tracebacks (where they can be read)."""
    texts = {}
    for name in sorted(files):
        try:
            with open(name, "rb") as f:
                data = f.read(MAX_SOURCE_BYTES + 1)
        except OSError:
            continue
        if len(data) <= MAX_SOURCE_BYTES:
            texts[name] = data.decode("utf-8", "replace")
    return texts


def _module_text(attribute: str, label: str, data: bytes, files: set[str]) -> str:
    version = PYTHON
    dotted = ".".join(map(str, version))
    return (
        f'"""Generated by rewardbox.sandboxed: {label}, shipped by value '
        f'(cloudpickle {cloudpickle.__version__}, Python {dotted})."""\n'
        "import base64, linecache, pickle, sys\n\n"
        f"if sys.version_info[:2] != {version!r}:\n"
        f"    raise RuntimeError(\"rewardbox.sandboxed ships {attribute} as Python {dotted} code (the training \"\n"
        "                       \"process's), but this sandbox runs Python %d.%d: set sandbox.docker.base_image to \"\n"
        f"                       \"auto (python:{dotted}-slim, the host's version) or to an image with Python {dotted}\""
        " % sys.version_info[:2])\n\n"
        f"_SOURCES = {_sources(files)!r}\n"
        "for _file, _text in _SOURCES.items():  # tracebacks show the lines of the training process's files\n"
        "    linecache.cache.setdefault(_file, (len(_text), None, _text.splitlines(True), _file))\n\n"
        f"{attribute} = pickle.loads(base64.b85decode({base64.b85encode(data)!r}))\n"
    )


def signature_style(fn: Callable) -> str:
    """``sample`` for ``fn(prompt, completion, example, ...)``, else ``batch`` (what TRL calls: anything a user
    passes as ``reward_funcs`` is written for it)."""
    try:
        parameters = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return "batch"
    positional = [p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return "sample" if positional[:3] == ["prompt", "completion", "example"] else "batch"

"""``rewardbox.sandboxed_tools``: a TRL script's tools, each call run in a sandbox, in one line.

    with rewardbox.sandboxed_tools([run_python, search], packages=["numpy"], timeout_s=10) as tools:
        GRPOTrainer(..., tools=tools).train()

TRL calls a tool in the trainer's own process with the arguments the model wrote. Here each tool is shipped by value
into a sandbox (as :func:`rewardbox.sandboxed` ships rewards), and each call runs there as one sample of a
``tool``-style function: under the default ``isolation: sample`` in a process prepared for that call alone, so nothing
one call does (files, processes, module state) reaches another, with the reward settings' limits, timeout and
retries of transient sandbox failures.

What TRL sees is what it would see in-process:

- each callable has the original's ``__name__``, docstring, signature and type hints
  (``transformers.utils.get_json_schema`` gives the same schema, so the model is shown the same tools);
- it is async (TRL gathers one rollout's calls) and returns what the tool returned: the value itself where JSON
  carries it exactly (str, int, float, bool, None, and lists and str-keyed dicts of them), else its ``str()`` (the
  text TRL puts in the conversation in-process is ``str(result)``: the same; but for a list JSON does not carry
  exactly, which TRL would pass on as a list of content parts);
- a tool's own exception is raised as :class:`ToolError` whose ``str()`` is the original's (TRL shows the model
  ``{"error": str(e)}``); a call the sandbox ended (``timeout_s``, a crash, the memory limit) raises
  :class:`ToolError` naming the tool and what ended it. Both are ``Exception``s, which TRL counts as failed calls.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import inspect
import json
import logging
import math
import tempfile
import time
import typing
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from ..errors import ConfigError
from ..report.tool_calls import CALLS
from ..scoring.client import RewardClient
from ..spec import Where, parse_config
from ..wire import DEFAULT_WARM, Status
from ..wire.pb import reward_pb2 as pb
from .dropin import SETTINGS, _check_settings, _installs, _merge, _spec_name, _validate
from .session import RewardSandboxes
from .shipping import Shipper, where

log = logging.getLogger("rewardbox")

# Reward settings that mean nothing for a tool: it has no score to fall back to or weigh, and its style is fixed.
NOT_FOR_TOOLS = ("style", "default_score", "weight")
TOOL_SETTINGS = tuple(s for s in SETTINGS if s not in NOT_FOR_TOOLS)


class ToolError(Exception):
    """A sandboxed tool call that did not return: ``str(e)`` is the tool's own exception's text (``status`` error),
    or says what ended the call (``timeout``, ``crash``, ``invalid``, ``unavailable``) and names the tool."""

    def __init__(self, message: str, tool: str, status: Status):
        super().__init__(message)
        self.tool = tool
        self.status = status


class SandboxedTools(list):
    """The callables :func:`sandboxed_tools` yields, in order (a plain list for TRL), with the running sandboxes as
    ``.sandboxes``."""

    sandboxes: RewardSandboxes


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a value a tool's JSON result carries (the sandbox sends it as text)")


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999: the sandbox sends an infinite float as its text, never as JSON
        raise ValueError(f"{text} is not a finite float")
    return value


_decode = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite).decode


def result_of(text: str) -> Any:
    """A tool's result as the sandbox carries it (``Score.result_json``, ASCII): ``"j"`` and its JSON (the value),
    or ``"s"`` and the JSON string of the ``str()`` of a value JSON does not carry exactly (that text).

    Raises:
        ValueError: the text is not one of these (a hostile call can write its answer itself).
    """
    try:
        value = _decode(text[1:])
    except (ValueError, RecursionError) as e:  # malformed, too deep, an int past the digit limit
        raise ValueError(f"a result that does not decode ({type(e).__name__}: {str(e)[:200]})") from None
    if text[:1] == "s" and not isinstance(value, str):
        raise ValueError("a text result that is not a JSON string")
    if text[:1] not in ("j", "s"):
        raise ValueError("a result of neither form")
    return value


def ended_how(status: Status) -> str:
    """What a call's status says happened to it, in words (not for ``error``: the callable raised)."""
    return {Status.TIMEOUT: "timed out", Status.CRASH: "crashed", Status.INVALID: "returned what a sandbox cannot "
            "send back", Status.UNAVAILABLE: "could not reach its sandbox"}.get(status, str(status))


def _failure(name: str, status: Status, error: str) -> ToolError:
    if status is Status.ERROR:  # the tool raised: its own text, as TRL would show it in-process
        return ToolError(error, name, status)
    return ToolError(f"rewardbox: tool {name!r} {ended_how(status)}: {error}", name, status)


def _arguments(fn: Callable, name: str, args: tuple, kwargs: dict) -> str:
    """The call's arguments as the JSON object the sandbox calls the tool with (TRL passes keywords only; positional
    ones are named by the original's signature)."""
    if args:
        try:
            kwargs = dict(inspect.signature(fn).bind_partial(*args, **kwargs).arguments)
        except TypeError as e:
            raise TypeError(f"{name}(): {e}") from None
    try:
        return json.dumps(kwargs, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}(): a sandboxed tool takes JSON values as arguments (what a model writes): {e}") \
            from None


def _proxy(fn: Callable, name: str, client: RewardClient) -> Callable:
    """An async function with ``fn``'s name, docstring, signature and type hints (``functools.wraps`` sets
    ``__wrapped__``, which ``inspect.signature`` and ``typing.get_type_hints`` follow) that runs ``fn`` in the
    sandbox ``client`` reaches."""
    shown = getattr(fn, "__name__", name)
    # At most as many calls in the sandboxes as they run at once: the others wait here, not in a sandbox's queue,
    # where the wait would count against their deadline (and a sandbox serves queued calls in no set order).
    spec = client.reward
    running = spec.workers * (spec.concurrency if inspect.iscoroutinefunction(fn) else 1)
    if spec.isolation != "worker":
        running = min(running, max(spec.workers, spec.warm or DEFAULT_WARM))
    limit = max(1, running) * len(client.replicas)
    gates: dict = {}  # per event loop

    @functools.wraps(fn)
    async def call(*args: Any, **kwargs: Any) -> Any:
        arguments = _arguments(fn, shown, args, kwargs)
        sample = pb.Sample(columns_json=arguments)
        loop = asyncio.get_running_loop()
        gate = gates.get(loop)
        if gate is None:
            for old in [k for k in gates if k.is_closed()]:
                del gates[old]
            gate = gates[loop] = asyncio.Semaphore(limit)
        started = time.monotonic()
        async with gate:
            report = await client.score([sample])
        status, value, error = report.statuses[0], report.values[0], report.errors[0] or ""
        if status is Status.OK:
            try:
                result = result_of(value)
            except ValueError as e:
                status, error = Status.INVALID, str(e)
            else:
                CALLS.note(shown, json.loads(arguments), started, status, result=result)
                return result
        failure = _failure(shown, status, error)
        CALLS.note(shown, json.loads(arguments), started, status, error=str(failure))
        raise failure

    return call


def _check_tool(fn: Any, i: int) -> str:
    """The tool's name, or a ConfigError naming what is wrong with it (TRL takes functions and bound methods)."""
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        raise ConfigError(f"rewardbox.sandboxed_tools: tools[{i}] is a {type(fn).__name__}, not a function: TRL "
                          "builds a tool's schema from a function's name, signature and docstring (a def, or a "
                          "bound method)")
    return fn.__name__


@contextlib.contextmanager
def sandboxed_tools(tools: Sequence[Callable], *, sandbox: Optional[dict] = None, backend=None,
                    **settings: Any) -> Iterator[SandboxedTools]:
    """Runs each call of each of ``tools`` (what a script passes as ``GRPOTrainer(tools=...)``) in a sandbox, and
    yields async tool callables in the same order with the same names, docstrings, signatures and type hints.

    Args:
        tools: functions (sync or async) or bound methods.
        sandbox: the config's ``sandbox:`` section (backend, docker settings...); by default the docker backend.
        backend: a backend object to start the sandboxes on instead (it stays the caller's).
        settings: sandbox settings for every tool, the reward settings but ``style``, ``default_score`` and
            ``weight``: ``packages``, ``system_packages``, ``timeout_s`` (per call), ``retries`` (of transient
            sandbox failures), ``isolation``, ``memory``, ``network``, ``secrets``, ``env``...

    Raises:
        ConfigError: a setting is unknown or invalid, or a tool is not a function or cannot be shipped (naming it
        and why); plus what :meth:`RewardSandboxes.start` raises. Nothing is left running then.
    """
    unknown = sorted(set(settings) & set(NOT_FOR_TOOLS))
    if unknown:
        raise ConfigError(f"rewardbox.sandboxed_tools: {', '.join(map(repr, unknown))} mean nothing for a tool (it "
                          f"returns what it returns, and raises what it raises); its settings are "
                          f"{', '.join(TOOL_SETTINGS)}")
    _check_settings(settings, "sandboxed_tools(...)")
    shipper = Shipper("sandboxed_tools")
    entries: list[dict] = []
    names: set[str] = set()
    with tempfile.TemporaryDirectory(prefix="rewardbox-tools-") as folder:
        for i, fn in enumerate(tools):
            title = _check_tool(fn, i)
            label = f"tools[{i}] {title} ({where(fn)})"
            merged = {**_merge(settings, {}), "style": "tool"}
            name = _spec_name(title, names)
            shipment = shipper.ship(fn, "tool", label, list(merged.get("packages", [])))
            for requirement, what in shipment.inferred.items():
                log.info("rewardbox.sandboxed_tools: %s refers to %s: its sandbox gets %s (the host's version)",
                         label, what, requirement)
            source = Path(folder) / f"{name}.py"
            source.write_text(shipment.source)
            _validate({**merged, "name": name, "source": str(source)}, label)
            entries.append({**merged, "name": name, "source": str(source), "function": "tool",
                            "packages": shipment.packages if _installs(sandbox, backend)
                            else merged.get("packages", [])})
        config = parse_config({"sandbox": sandbox or {}, "rewards": entries}, Path.cwd(),
                              Where(file="rewardbox.sandboxed_tools(...)"))
        with RewardSandboxes(config, backend=backend) as sandboxes:
            out = SandboxedTools(_proxy(fn, entry["name"], sandboxes[entry["name"]].client)
                                 for fn, entry in zip(tools, entries))
            out.sandboxes = sandboxes
            yield out


# -- tools named in a config (`tools:` of `rewardbox train`) -------------------------------------------------------

# What a tool's type hints in a config may name: the host reads them from the file's text (it never imports the
# file, whose packages are the sandbox's), so only built-in types and typing's forms, which need nothing imported.
_HINT_NAMES: dict[str, Any] = {
    "int": int, "float": float, "str": str, "bool": bool, "bytes": bytes, "list": list, "dict": dict,
    "tuple": tuple, "set": set, "None": None, "object": object,
    **{name: getattr(typing, name) for name in ("Any", "Optional", "Union", "Literal", "List", "Dict", "Tuple",
                                                 "Set", "Sequence", "Mapping")},
}


def _hint(node: ast.expr, where: str) -> Any:
    """A type hint from its syntax, built from :data:`_HINT_NAMES` and constants (for ``Literal``) only."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _HINT_NAMES:
        return _HINT_NAMES[node.id]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("typing", "t") \
            and node.attr in _HINT_NAMES:
        return _HINT_NAMES[node.attr]
    if isinstance(node, ast.Subscript):
        base = _hint(node.value, where)
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        args = tuple(_hint(item, where) for item in items)
        return base[args if len(args) > 1 else args[0]]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return typing.Union[_hint(node.left, where), _hint(node.right, where)]
    raise ConfigError(f"{where}: the type hint {ast.unparse(node)!r} names something other than built-in types and "
                      f"typing's forms ({', '.join(sorted(_HINT_NAMES))}): a tool named in a config is read from "
                      "its file's text, never imported on the host (its packages are the sandbox's); describe its "
                      "arguments with those")


def stub_from_source(path: Path, function: str) -> Callable:
    """A function with the name, docstring, signature and type hints of the ``def function`` in ``path``, read
    from the file's syntax (nothing of it runs on the host), for :func:`transformers.utils.get_json_schema`.

    Raises:
        ConfigError: no such ``def`` at the top of the file, or a hint or default that cannot be read without
        running the file's code (naming file and line).
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    node = next((n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == function), None)
    if node is None:
        raise ConfigError(f"{path}: no top-level `def {function}(...)`: a tool named in a config must be defined "
                          "with def at the top of its file (the host reads its signature and docstring from there)")
    return _stub(node, path)


def class_stub_from_source(path: Path, name: str) -> type:
    """A class with the name, docstring and methods (stand-ins with each one's signature, docstring and type hints,
    async where the original is) of ``class name`` in ``path``, read from the file's syntax: what
    :func:`rewardbox.api.environments.proxy_class` reads an environment's tools from.

    Raises:
        ConfigError: no such class at the top of the file, or a method whose hints or defaults cannot be read.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    node = next((n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)
    if node is None:
        raise ConfigError(f"{path}: no top-level `class {name}`: an environment named in a config must be a class "
                          "defined at the top of its file (the host reads its methods from there)")
    methods = {n.name: _stub(n, path, method=True) for n in node.body
               if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")}
    stub = type(name, (), {**methods, "__doc__": ast.get_docstring(node), "__module__": "rewardbox.config"})
    return stub


def _stub(node: Union[ast.FunctionDef, ast.AsyncFunctionDef], path: Path, method: bool = False) -> Callable:
    function = node.name
    where = f"{path}:{node.lineno}"
    arguments = node.args
    if arguments.vararg or arguments.posonlyargs or (arguments.kwarg and not (method and function == "reset")):
        raise ConfigError(f"{where}: {function}() takes *args, **kwargs or positional-only parameters: a tool is "
                          "called with its arguments by name (TRL passes the JSON object the model wrote)")
    defaults: list = [inspect.Parameter.empty] * (len(arguments.args) - len(arguments.defaults)) + [
        *arguments.defaults]
    parameters, hints = [], {}
    for arg, default, kind in [*((a, d, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                                 for a, d in zip(arguments.args, defaults)),
                               *((a, d if d is not None else inspect.Parameter.empty, inspect.Parameter.KEYWORD_ONLY)
                                 for a, d in zip(arguments.kwonlyargs, arguments.kw_defaults))]:
        if default is not inspect.Parameter.empty:
            try:
                default = ast.literal_eval(default)
            except ValueError:
                raise ConfigError(f"{where}: the default of {arg.arg!r} is not a literal the host can read without "
                                  "running the file") from None
        annotation = inspect.Parameter.empty
        if arg.annotation is not None:
            annotation = hints[arg.arg] = _hint(arg.annotation, where)
        parameters.append(inspect.Parameter(arg.arg, kind, default=default, annotation=annotation))
    if arguments.kwarg:
        parameters.append(inspect.Parameter(arguments.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    returns = inspect.Signature.empty
    if node.returns is not None:
        returns = hints["return"] = _hint(node.returns, where)

    def stub(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a signature stand-in: the tool runs in its sandbox")

    async def async_stub(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("a signature stand-in: the tool runs in its sandbox")

    made = async_stub if isinstance(node, ast.AsyncFunctionDef) else stub
    made.__name__ = made.__qualname__ = function
    made.__doc__ = ast.get_docstring(node)
    made.__annotations__ = hints
    setattr(made, "__signature__", inspect.Signature(parameters, return_annotation=returns))  # inspect reads it
    return made


def tools_from_config(config, specs: Sequence, backend=None) -> tuple[RewardSandboxes, SandboxedTools]:
    """Starts sandboxes for the tools a training config names (``tools:``, each a reward entry of style ``tool``)
    and returns them with their callables, in order; the caller stops the sandboxes.

    Raises:
        ConfigError: a tool's signature cannot be read from its file; plus what :meth:`RewardSandboxes.start` raises.
    """
    stubs = [stub_from_source(config.source_path(spec), spec.function_name) for spec in specs]
    tools_config = config.model_copy(update={"rewards": list(specs)})
    sandboxes = RewardSandboxes(tools_config, backend=backend)
    sandboxes.start()
    out = SandboxedTools(_proxy(stub, spec.name, sandboxes[spec.name].client) for stub, spec in zip(stubs, specs))
    out.sandboxes = sandboxes
    return sandboxes, out

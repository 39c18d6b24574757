"""rewardbox.sandboxed_tools: what TRL sees of a sandboxed tool (its schema, its results, its errors) is what it sees
of the original in-process. Sandboxes run on the local backend here (real processes, real gRPC, the real codec);
tests/docker/test_tools.py runs hostile calls in real containers, tests/trainer/test_tools_trainer.py a real
GRPOTrainer."""

from __future__ import annotations

import asyncio
import math
from typing import Literal, Optional

import pytest
from transformers.utils import get_json_schema

from rewardbox import ConfigError, ToolError, sandboxed_tools
from tests.conftest import run

LOCAL = {"backend": "local"}


def add(a: int, b: int = 2) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


async def lookup(key: Literal["pi", "e"], digits: Optional[int] = None) -> str:
    """Looks a constant up.

    Args:
        key: which constant
        digits: how many digits to show

    Returns:
        The constant, as text.
    """
    value = {"pi": math.pi, "e": math.e}[key]
    return f"{value:.{digits}f}" if digits is not None else str(value)


def values(kind: str) -> object:
    """Returns a value of the kind asked for.

    Args:
        kind: which kind
    """
    return VALUES[kind]


VALUES = {
    "int": 7, "big": 10 ** 40, "float": 0.1, "negative zero": -0.0, "bool": True, "none": None,
    "str": "héllo \x00 ✓",
    "list": [1, "a", None, [2.5, False]], "dict": {"a": {"b": [1, {"c": None}]}, "z": 1, "é": "x"},
    "empty": {}, "tuple": (1, 2), "int key": {1: "a"}, "nan": float("nan"), "inf": float("inf"), "set": {3},
    "float of int": 1.0, "list with tuple": [(1, 2)], "bytes": b"\x00x", "object": object.__new__(type("Thing", (), {
        "__str__": lambda self: "a thing"})),
}


def raises(message: str) -> str:
    """Raises what it is told.

    Args:
        message: the text
    """
    raise KeyError(message)


class Counter:
    def __init__(self, start: int):
        self.start = start

    def bump(self, by: int) -> int:
        """Adds to the start.

        Args:
            by: how much
        """
        self.start += by
        return self.start


def test_schemas_names_and_docstrings_are_the_originals():
    counter = Counter(10)
    originals = [add, lookup, values, raises, counter.bump]
    with sandboxed_tools(originals, sandbox=LOCAL) as tools:
        assert isinstance(tools, list) and len(tools) == len(originals)
        for tool, original in zip(tools, originals):
            assert get_json_schema(tool) == get_json_schema(original)
            assert tool.__name__ == original.__name__ and tool.__doc__ == original.__doc__
            assert asyncio.iscoroutinefunction(tool)  # TRL gathers a rollout's async calls
        assert run(tools[0](a=1)) == 3
        assert run(tools[0](5, b=1)) == 6  # positional arguments are named by the original's signature
        assert run(tools[1](key="pi", digits=3)) == "3.142"  # an async tool
        # A bound method's instance is shipped with it; each call starts from it as shipped (fresh state).
        assert [run(tools[4](by=1)), run(tools[4](by=1))] == [11, 11]


def test_results_come_back_as_values_or_as_the_text_trl_would_show():
    with sandboxed_tools([values], sandbox=LOCAL) as (tool,):
        for kind, original in VALUES.items():
            got = run(tool(kind=kind))
            # What TRL puts in the conversation: a list as it is, anything else as str(result).
            assert str(got) == str(original), kind
            if kind in ("int", "big", "float", "bool", "none", "str", "list", "dict", "empty", "float of int"):
                assert got == original and type(got) is type(original), kind  # JSON carries these exactly
            if kind == "negative zero":
                assert math.copysign(1, got) == -1
            if kind in ("tuple", "int key", "nan", "inf", "set", "list with tuple", "bytes", "object"):
                assert got == str(original), kind  # the text of what JSON does not carry exactly


def test_a_tools_exception_has_the_same_text_as_in_process():
    with sandboxed_tools([raises, add, lookup], sandbox=LOCAL) as (bad, adds, looks):
        for call, original in [(lambda: bad(message="no such file"), lambda: raises(message="no such file")),
                               (lambda: adds(a=1, c=2), lambda: add(a=1, c=2)),
                               (lambda: adds(), lambda: add()),
                               (lambda: looks(key="tau"), lambda: asyncio.run(lookup(key="tau")))]:
            with pytest.raises(Exception) as in_process:
                original()
            with pytest.raises(ToolError) as sandboxed:
                run(call())
            assert str(sandboxed.value) == str(in_process.value)
            assert isinstance(sandboxed.value, Exception)  # TRL counts an Exception as a failed call


def test_a_result_too_large_to_send_back_fails_naming_the_tool_and_the_bound():
    def big(n: int) -> str:
        """Returns n characters.

        Args:
            n: how many
        """
        return "x" * n

    with sandboxed_tools([big], sandbox=LOCAL) as (tool,):
        assert len(run(tool(n=200_000))) == 200_000
        with pytest.raises(ToolError, match=r"^rewardbox: tool 'big' returned what a sandbox cannot send back: its "
                                            r"result takes 300003 bytes \(as JSON, or its str\(\)\), over the "
                                            r"256 KiB"):
            run(tool(n=300_000))


def test_arguments_past_the_call_bound_fail_naming_the_tool_and_the_bound():
    def echo(text: str) -> int:
        """Counts characters.

        Args:
            text: the text
        """
        return len(text)

    with sandboxed_tools([echo], sandbox=LOCAL, memory="256m") as (tool,):  # 8 MiB a call
        assert run(tool(text="x" * (4 << 20))) == 4 << 20
        with pytest.raises(ToolError, match=r"^this call's arguments are 9\.0 MiB, more than one call to tool 'echo' "
                                            r"may carry \(8\.0 MiB, 1/32 of its `memory: 256m`.*raise `memory:` of "
                                            r"the tool$"):
            run(tool(text="x" * (9 << 20)))


def test_bad_tools_and_settings_are_refused_before_anything_starts():
    with pytest.raises(ConfigError, match=r"tools\[1\] is a Counter, not a function"):
        with sandboxed_tools([add, Counter(1)], sandbox=LOCAL):
            pass
    with pytest.raises(ConfigError, match=r"'default_score' mean nothing for a tool"):
        with sandboxed_tools([add], sandbox=LOCAL, default_score=0.0):
            pass
    with pytest.raises(ConfigError, match=r"unknown setting 'timeout'"):
        with sandboxed_tools([add], sandbox=LOCAL, timeout=3):
            pass
    with sandboxed_tools([add], sandbox=LOCAL) as (tool,):
        with pytest.raises(TypeError, match=r"add\(\): a sandboxed tool takes JSON values as arguments"):
            run(tool(a=object()))


def test_a_config_tools_schema_is_read_from_its_files_text_without_importing_it(tmp_path):
    from rewardbox.api.tools import stub_from_source

    source = '''
import not_installed_here  # the sandbox's package: the host never imports this file
from typing import Literal, Optional


def run(code: str, lang: Literal["py", "sh"] = "py", limit: Optional[int] = None, *,
        tags: list[str] | None = None) -> dict[str, int]:
    """Runs code.

    Args:
        code: the program
        lang: which language
        limit: seconds
        tags: labels
    """
'''
    (tmp_path / "tools.py").write_text(source)
    namespace: dict = {}
    exec(source.replace("import not_installed_here", ""), namespace)
    stub = stub_from_source(tmp_path / "tools.py", "run")
    assert get_json_schema(stub) == get_json_schema(namespace["run"])
    with pytest.raises(ConfigError, match=r"no top-level `def missing\(\.\.\.\)`"):
        stub_from_source(tmp_path / "tools.py", "missing")
    (tmp_path / "bad.py").write_text("def f(x: __import__('os').system('true')) -> int:\n    pass\n")
    with pytest.raises(ConfigError, match=r"bad\.py:1: the type hint .* names something other"):
        stub_from_source(tmp_path / "bad.py", "f")

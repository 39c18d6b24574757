"""Hostile tool calls beside innocent ones, in real containers (runc and gVisor), through rewardbox.sandboxed_tools.

A tool runs model-written actions: each hostile call below runs at the same time as innocent calls of another tool
in the same sandbox, and each innocent reports everything of an earlier or concurrent call it can find (module
state, files in /tmp and its directory, environment, processes of its uid). Every test asserts each innocent's exact
result, the hostile call's error (naming the tool and the limit where the sandbox ended it), and a later round of
innocents that finds nothing either.
"""

from __future__ import annotations

import asyncio
import os
import re

import pytest

from rewardbox import ToolError, sandboxed_tools
from rewardbox.wire import Status
from tests.docker.probes import processes_of_my_uid

STATE: list = []  # module state a call could try to leave for the next one


def inspect_and_mark(tag: str) -> dict:
    """Reports what an earlier or concurrent call left, then leaves marks of its own.

    Args:
        tag: this call's name
    """
    import os

    found = []
    if STATE:
        found.append(f"module state {STATE}")
    if os.environ.get("PLANTED"):
        found.append("environment")
    for where in ("/tmp", "."):
        if os.listdir(where):
            found.append(f"files in {where}: {sorted(os.listdir(where))}")
    found += processes_of_my_uid()
    STATE.append(tag)
    os.environ["PLANTED"] = tag
    with open(f"/tmp/{tag}", "w") as f:
        f.write(tag)
    return {"tag": tag, "found": found}


def act(action: str) -> str:
    """Does something hostile.

    Args:
        action: what
    """
    import os
    import signal
    import socket
    import subprocess
    import time

    if action == "loop":
        while True:
            pass
    if action == "fork bomb":
        while True:
            try:
                os.fork()
            except OSError:
                pass
    if action == "kill -1":
        os.kill(-1, signal.SIGKILL)
        time.sleep(0.5)
        return "still here"
    if action == "memory":
        hog = bytearray(1 << 30)
        return f"allocated {len(hog)}"
    if action == "host files":
        for path in ("/etc/passwd", "/usr/lib/python3/rbx_planted.py", "/proc/1/environ"):
            try:
                with open(path, "a") as f:
                    f.write("planted")
                return f"wrote {path}"
            except OSError:
                pass
        raise PermissionError("every host path refused")
    if action == "environment":
        return repr(sorted(os.environ.items()))
    if action == "network":
        socket.create_connection(("1.1.1.1", 53), timeout=2)
        return "connected"
    if action == "leave behind":
        subprocess.Popen(["sleep", "30"], start_new_session=True)
        with open("/tmp/rbx_planted", "w") as f:
            f.write("x")
        os.environ["PLANTED"] = "yes"
        STATE.append("hostile")
        return "left"
    raise ValueError(f"no action {action!r}")


INNOCENTS = 5


@pytest.fixture(scope="module", params=["runc", "runsc"])
def tools(request, docker_client, base_image):
    if request.param == "runsc" and "runsc" not in docker_client.info().get("Runtimes", {}):
        pytest.fail("the Docker engine has no runsc runtime: start it as scripts/setup.sh does")
    os.environ["RBX_HOST_SECRET"] = "hunter2"  # the trainer's environment: no tool may read it
    sandbox = {"backend": "docker", "docker": {"base_image": base_image,
                                               "runtime": None if request.param == "runc" else "runsc"}}
    try:
        with sandboxed_tools([inspect_and_mark, act], sandbox=sandbox, timeout_s=2, memory="512m",
                             retries=0) as started:
            yield started
    finally:
        os.environ.pop("RBX_HOST_SECRET", None)


async def _round(tools, action=None):
    inspect, hostile = tools
    calls = [inspect(tag=f"innocent{i}") for i in range(INNOCENTS)]
    if action is not None:
        calls.insert(INNOCENTS // 2, hostile(action=action))
    return await asyncio.gather(*calls, return_exceptions=True)


def _check_innocents(results):
    innocents = [r for r in results if isinstance(r, dict)]
    assert [r["tag"] for r in innocents] == [f"innocent{i}" for i in range(INNOCENTS)]
    assert all(r["found"] == [] for r in innocents), innocents


@pytest.mark.parametrize("action,status,message", [
    ("loop", Status.TIMEOUT, r"^rewardbox: tool 'act' timed out: exceeded timeout_s=2"),
    ("fork bomb", None, r"^rewardbox: tool 'act' (timed out|crashed)"),
    # Killed past the sandbox's memory (runc), or a MemoryError whose text is empty, as in-process (gVisor)
    ("memory", None, r"^(rewardbox: tool 'act' crashed.*|)$"),
    ("host files", Status.ERROR, r"^every host path refused$"),
    ("network", Status.ERROR, r"unreachable|No route to host|timed out"),
])
def test_a_hostile_call_fails_alone_and_innocents_beside_it_and_after_it_find_nothing(tools, action, status,
                                                                                       message):
    results = asyncio.run(_round(tools, action))
    hostile = results[INNOCENTS // 2]
    assert isinstance(hostile, ToolError), hostile
    assert status is None or hostile.status is status
    assert re.search(message, str(hostile)), str(hostile)
    _check_innocents(results[:INNOCENTS // 2] + results[INNOCENTS // 2 + 1:])
    _check_innocents(asyncio.run(_round(tools)))


def test_kill_minus_one_and_leftovers_reach_no_other_call(tools):
    for action in ("kill -1", "leave behind"):
        results = asyncio.run(_round(tools, action))
        hostile = results[INNOCENTS // 2]
        # kill(-1) may take its own slot process with it (runc: the call then crashed), or find nothing it may
        # signal (gVisor: ESRCH, the tool's own error); it reaches no other call.
        assert hostile in ("still here", "left") or (isinstance(hostile, ToolError) and hostile.status in (
            Status.CRASH, Status.ERROR)), hostile
        _check_innocents(results[:INNOCENTS // 2] + results[INNOCENTS // 2 + 1:])
        _check_innocents(asyncio.run(_round(tools)))


def test_a_tool_never_sees_the_trainers_environment(tools):
    environment = asyncio.run(tools[1](action="environment"))
    assert "hunter2" not in environment and "RBX_HOST_SECRET" not in environment


def run_code(code: str) -> object:
    """Runs code and returns its `result`.

    Args:
        code: python
    """
    namespace: dict = {}
    exec(code, namespace)
    return namespace.get("result")


# A call that writes an answer of its own where its process's answer goes and exits: the answer format's checks, and
# the host's, are all that stand between it and the trainer.
FORGE = r'''
import os, sys
from rewardbox.sandbox.protocol import codec
# A call's process answers on its request's socket, after the start byte its serving code wrote (found in that
# code's frame): a forged answer there is what the sandbox's server reads.
frame = sys._getframe()
while frame.f_code.co_name != "_handle":
    frame = frame.f_back
request = frame.f_locals["sock"]
body = codec._HEADER.pack(codec.MAGIC, 1, 0, 0) + codec._SAMPLE.pack(STATUS, HAS, 0.0, len(TEXT), 0.0) + TEXT
request.sendall(body)
os._exit(0)
'''


@pytest.fixture(scope="module")
def code_tool(docker_client, base_image):
    sandbox = {"backend": "docker", "docker": {"base_image": base_image}}
    with sandboxed_tools([run_code], sandbox=sandbox, timeout_s=1, retries=0) as (tool,):
        yield tool


@pytest.mark.parametrize("text,has", [(b"j{not json", 2), (b"j1e999", 2), (b"jNaN", 2), (b"j" + b"[" * 100000, 2),
                                      (b"x-neither form", 2), (b"s123", 2), (b"", 0)])
def test_a_forged_answer_is_the_calls_invalid_never_another_exception_or_value(code_tool, text, has):
    code = f"TEXT = {text!r}\nSTATUS = {Status.OK.wire}\nHAS = {has}\n" + FORGE
    with pytest.raises(ToolError) as raised:
        asyncio.run(code_tool(code=code))
    assert raised.value.status is Status.INVALID, raised.value


@pytest.mark.parametrize("code,expected", [
    ("result = 'a\\ud800b\\ud83d'", "a\ud800b\ud83d"),  # lone surrogates: exactly (ASCII JSON)
    ("class S(str):\n    def __repr__(self): return 'REPR'\nresult = {S('a'): 1}", "{REPR: 1}"),
    ("import sys\nsys.set_int_max_str_digits(0)\nresult = 10 ** 5000", None),
])
def test_values_come_back_as_trl_would_show_them(code_tool, code, expected):
    if expected is None:  # an int past the host's digit limit: the call's own failure, never the host's exception
        with pytest.raises(ToolError):
            asyncio.run(code_tool(code=code))
        return
    got = asyncio.run(code_tool(code=code))
    assert str(got) == expected


def test_exits_and_raising_str_are_the_tools_own_errors_without_a_traceback(code_tool, docker_client, base_image):
    with pytest.raises(ToolError, match=r"^bad str$"):
        asyncio.run(code_tool(code="class B:\n    def __str__(self): raise ValueError('bad str')\nresult = B()"))

    async def exits(code: int) -> str:
        """Exits.

        Args:
            code: status
        """
        raise SystemExit(code)

    with sandboxed_tools([exits], sandbox={"backend": "docker", "docker": {"base_image": base_image}}) as (tool,):
        with pytest.raises(ToolError, match=r"^SystemExit\(3\) raised by the tool$"):
            asyncio.run(tool(code=3))


def test_calls_queued_behind_slow_ones_wait_their_turn_instead_of_failing(code_tool):
    # 30 calls that run to their 1 s timeout ahead of 10 innocents, on 2 workers: the innocents wait about 15 s,
    # which is past one call's own deadline; each call's deadline counts the calls ahead of it.
    async def calls():
        slow = [code_tool(code="while True: pass") for _ in range(30)]
        quick = [code_tool(code=f"result = {i}") for i in range(10)]
        return await asyncio.gather(*slow, *quick, return_exceptions=True)

    results = asyncio.run(calls())
    odd = [str(r) for r in results[:30] if not (isinstance(r, ToolError) and r.status is Status.TIMEOUT)]
    assert not odd, odd
    assert results[30:] == list(range(10))


# A hostile call that leaves a daemon listening on a loopback port and on an abstract Unix socket name, and returns
# at once; and what an innocent finds alone (red team of #41: innocents called back to back after it found the port
# taken and the daemon answering, until its slot was next prepared).
LEAVE_A_LISTENER = r'''
import os, socket
tcp = socket.socket()
tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
tcp.bind(("127.0.0.1", 45678))
tcp.listen(8)
named = socket.socket(socket.AF_UNIX)
named.bind("\0rbx-innocent")
named.listen(8)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        while True:
            c, _ = tcp.accept()
            c.sendall(b"EVIL")
            c.close()
    os._exit(0)
result = "left"
'''
LOOK_FOR_A_LISTENER = r'''
import socket
found = []
s = socket.socket()
try:
    s.bind(("127.0.0.1", 45678))
    found.append("bind ok")
except OSError as e:
    found.append(f"bind failed: {e}")
s.close()
try:
    found.append(f"connect got {socket.create_connection(('127.0.0.1', 45678), 1).recv(4)!r}")
except OSError as e:
    found.append(f"connect: {type(e).__name__}")
u = socket.socket(socket.AF_UNIX)
try:
    u.bind("\0rbx-innocent")
    found.append("abstract bind ok")
except OSError as e:
    found.append(f"abstract bind failed: {e}")
u.close()
result = repr(found)
'''
NOTHING_LEFT = repr(["bind ok", "connect: ConnectionRefusedError", "abstract bind ok"])


def test_what_a_call_left_on_the_network_reaches_no_later_call(code_tool):
    assert asyncio.run(code_tool(code=LOOK_FOR_A_LISTENER)) == NOTHING_LEFT  # alone

    async def calls() -> list:
        assert await code_tool(code=LEAVE_A_LISTENER) == "left"
        return [await code_tool(code=LOOK_FOR_A_LISTENER) for _ in range(40)]  # back to back

    seen = asyncio.run(calls())
    assert seen == [NOTHING_LEFT] * 40, [r for r in seen if r != NOTHING_LEFT][:3]

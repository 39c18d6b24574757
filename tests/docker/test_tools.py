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

STATE: list = []  # module state a call could try to leave for the next one


def inspect_and_mark(tag: str) -> dict:
    """Reports what an earlier or concurrent call left, then leaves marks of its own.

    Args:
        tag: this call's name
    """
    import os

    me, found = os.getuid(), []
    if STATE:
        found.append(f"module state {STATE}")
    if os.environ.get("PLANTED"):
        found.append("environment")
    for where in ("/tmp", "."):
        if os.listdir(where):
            found.append(f"files in {where}: {sorted(os.listdir(where))}")
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) not in (os.getpid(), os.getppid()):
            try:
                with open(f"/proc/{pid}/status") as f:
                    status = f.read()
            except OSError:
                continue
            if f"Uid:\t{me}\t" in status and "State:\tZ" not in status:
                found.append(f"process {pid}")
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

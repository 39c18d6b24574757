"""``tree.empty``: what it removes and what it puts back on the directory itself, on the file system the tests'
temporary directories are on (ext4 on our machines), in a process that dropped ``SYS_ADMIN`` as the sandbox's
processes do: no container needed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

# In a process without SYS_ADMIN, as a sample (which plants the flags) and the slot process after it (which empties)
# run: ext4 refuses such a process to clear the extents flag it marks every directory with, and with every flag
# cleared the local backend's slots never started where their directories were on ext4.
CHILD = """
import fcntl, os, sys
from rewardbox.sandbox.confine.private_tmp import drop_sys_admin
from rewardbox.sandbox.processes.tree import empty

drop_sys_admin()
fd = os.open(sys.argv[1], os.O_RDONLY)
own = int.from_bytes(fcntl.ioctl(fd, 0x80086601, bytes(8))[:4], sys.byteorder)  # FS_IOC_GETFLAGS
empty(sys.argv[1])  # a directory with the file system's flags alone
if sys.argv[2] == "plant":
    fcntl.ioctl(fd, 0x40086602, (own | 0xC0).to_bytes(8, sys.byteorder))  # FS_IOC_SETFLAGS: nodump and noatime too
    planted = int.from_bytes(fcntl.ioctl(fd, 0x80086601, bytes(8))[:4], sys.byteorder)
    assert planted & 0xC0 == 0xC0, hex(planted)
    empty(sys.argv[1])
print(own, int.from_bytes(fcntl.ioctl(fd, 0x80086601, bytes(8))[:4], sys.byteorder))
"""


@pytest.mark.parametrize("flags", ["plant", "none planted"])
def test_empty_removes_everything_and_clears_the_flags_an_owner_sets_but_not_the_file_systems_own(tmp_path, flags):
    top = tmp_path / "scratch"
    (top / "a" / "b").mkdir(parents=True)
    (top / "a" / "b" / "file").write_text("x")
    (top / "link").symlink_to("/etc/passwd")
    done = subprocess.run([sys.executable, "-c", CHILD, str(top), flags], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    own, after = map(int, done.stdout.split())
    assert after == own  # nodump and noatime cleared, the file system's own flags (ext4: extents) kept
    assert os.listdir(top) == []
    assert (os.stat(top).st_mode & 0o777) == 0o700


# The template's look for strangers among its children (what an ended slot process orphaned to it, its subreaper)
# counts the kernel's list where it holds as many pids as the template knows: run in a process of its own, which
# forks as the template does (a slot process, the runner) and is the subreaper of what they orphan.
STRANGERS = """
import os, signal, time
from types import SimpleNamespace
from rewardbox.sandbox.processes import tree
from rewardbox.sandbox.processes.template import Template

tree.become_subreaper()

def sleeper():
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    return pid

slot, runner = sleeper(), sleeper()
template = SimpleNamespace(by_pid={slot: object()}, runner_pid=runner, _ended=None)
print(Template._strangers(template) == set())
middle = os.fork()  # a slot process's child that forks and dies: its own child is orphaned to us
if middle == 0:
    sleeper()
    os._exit(0)
os.waitpid(middle, 0)  # its orphan is ours before its parent is reaped
orphans = tree.children() - {slot, runner}
print(len(orphans) == 1 and Template._strangers(template) == orphans)
os.kill(runner, signal.SIGKILL)
os.waitid(os.P_PID, runner, os.WEXITED | os.WNOWAIT)  # it has exited; still ours to reap
Template._reap(template)  # reaps the runner (and forgets its pid: one fewer child now, the orphan still there)
print(template.runner_pid == 0 and Template._strangers(template) == orphans)
for pid in orphans | {slot}:
    os.kill(pid, signal.SIGKILL)
"""


def test_strangers_among_the_templates_children_are_found_by_their_count_and_a_reaped_runner_is_forgotten():
    out = subprocess.run([sys.executable, "-c", STRANGERS], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"] * 3, out.stdout + out.stderr

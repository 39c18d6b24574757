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

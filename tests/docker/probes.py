"""What a call or an episode in a sandbox can find of another one's processes: shipped by value into sandboxes with
the test functions that use it (standard library only)."""

from __future__ import annotations

import os


def processes_of_my_uid() -> list:
    """Every live process of this process's uid but itself and its parent (a slot process may share the uid and
    runs no reward code of its own), as "process PID"."""
    me, found = os.getuid(), []
    for pid in os.listdir("/proc"):
        if pid.isdigit() and int(pid) not in (os.getpid(), os.getppid()):
            try:
                with open(f"/proc/{pid}/status") as f:
                    status = f.read()
            except OSError:
                continue
            if f"Uid:\t{me}\t" in status and "State:\tZ" not in status:
                found.append(f"process {pid}")
    return found

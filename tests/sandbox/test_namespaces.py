"""``template.Namespaces``: the mount namespaces of ended slot processes are held while calls come back to back and
let go of (closed on a thread of the template's own) once they pause, or once too many are held. Descriptors of
pipes stand in for namespaces: what is checked is when each is closed."""

from __future__ import annotations

import os
import time

from rewardbox.sandbox.processes.template import Namespaces
from tests.conftest import until


def _closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False


def test_ended_processes_namespaces_are_held_while_calls_come_and_let_go_of_once_they_pause():
    namespaces = Namespaces()
    pipes = [os.pipe() for _ in range(3)]
    ours = [w for _, w in pipes]
    try:
        for r, _ in pipes:
            namespaces.release(r)
        namespaces.release(None)  # a process that sent none (gVisor, the local backend)
        namespaces.let_go(quiet=False)  # a burst of resets or tool calls: nothing is closed in its way
        time.sleep(0.05)
        assert not any(_closed(r) for r, _ in pipes) and len(namespaces.held) == 3
        namespaces.let_go(quiet=True)
        assert namespaces.held == []
        assert until(lambda: all(_closed(r) for r, _ in pipes), timeout_s=5.0)
    finally:
        for fd in ours:
            os.close(fd)


def test_a_burst_holds_at_most_so_many_namespaces():
    namespaces = Namespaces(most=8)
    pipes = [os.pipe() for _ in range(8)]
    try:
        for r, _ in pipes[:-1]:
            namespaces.release(r)
        namespaces.let_go(quiet=False)
        assert len(namespaces.held) == 7
        namespaces.release(pipes[-1][0])
        namespaces.let_go(quiet=False)  # the bound: handed over even as calls go on
        assert namespaces.held == []
        assert until(lambda: all(_closed(r) for r, _ in pipes), timeout_s=5.0)
    finally:
        for _, w in pipes:
            os.close(w)

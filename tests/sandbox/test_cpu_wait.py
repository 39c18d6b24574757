"""What a unit's processes waited for a CPU that others held (``rewardbox.sandbox.processes.cpu_wait``), measured on
real processes that compete for one CPU of this machine. The whole path, a hog beside innocents in real containers:
tests/docker/test_hostile.py::test_busy_processes_of_one_sample_do_not_time_out_the_innocents_beside_it."""

from __future__ import annotations

import os
import signal
import time

import pytest

from rewardbox.sandbox.processes import cpu_wait

CPU = min(os.sched_getaffinity(0))

def _spinner(*, children: int = 0) -> int:
    """A process on CPU that only spins (with ``children`` of its own that spin too); returns its pid."""
    pid = os.fork()
    if pid == 0:
        try:
            os.sched_setaffinity(0, {CPU})
            for _ in range(children):
                if os.fork() == 0:
                    break
            while True:
                pass
        finally:
            os._exit(0)
    return pid


def _stop(*pids: int) -> None:
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)


@pytest.fixture
def competitors():
    """Three busy processes on CPU, in no tree the tests watch."""
    pids = [_spinner() for _ in range(3)]
    yield
    _stop(*pids)


def test_a_lone_process_that_others_keep_waiting_is_forgiven_what_it_waited_between_two_looks(competitors):
    innocent = _spinner()
    try:
        watch = cpu_wait.Watch()
        time.sleep(0.3)
        watch.look([innocent])
        assert watch.sequential and watch.forgiven_s() == 0.0  # what it waited before the first look: no one saw
        time.sleep(1.0)
        watch.look([innocent])
        # one CPU, four busy processes: the innocent waited about three quarters of that second
        assert watch.sequential and 0.5 < watch.forgiven_s() < 1.0, watch.forgiven_s()
    finally:
        _stop(innocent)


def test_a_process_no_earlier_look_saw_earns_nothing(competitors):
    # Red team 10: busy processes that slept whenever the (then foreseeable) look came were credited the waits they
    # piled up for each other: a task's wait counts only from the first look that saw it.
    read, write = os.pipe()
    sleeper = os.fork()
    if sleeper == 0:
        os.write(write, b"s")
        time.sleep(60)
        os._exit(0)
    os.read(read, 1)  # past its start (whose wait for a CPU on a busy machine is no concern here)
    os.close(read)
    os.close(write)
    time.sleep(0.05)
    watch = cpu_wait.Watch()
    watch.look([sleeper])
    late = _spinner()
    try:
        time.sleep(0.5)
        watch.look([sleeper, late])
        # nothing of the late spinner's wait counts (the sleeper's own, to wake, is at most a few milliseconds)
        assert watch.sequential and watch.seen_ns[late] > 0.2e9 and watch.forgiven_s() < 0.05, watch.forgiven_s()
    finally:
        _stop(late, sleeper)


def test_a_tree_with_two_busy_processes_is_forgiven_nothing(competitors):
    hog = _spinner(children=1)
    try:
        time.sleep(0.5)
        watch = cpu_wait.Watch()
        watch.look([hog])
        assert not watch.sequential and watch.forgiven_s() == 0.0
    finally:
        for child in _descendants(hog):
            os.kill(child, signal.SIGKILL)
        _stop(hog)


def test_a_process_that_scores_itself_adds_at_most_its_budget_per_request(competitors):
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the slot process: one request, then its sample's timeout after 1.5 s of others' CPU
        try:
            os.sched_setaffinity(0, {CPU})
            cpu_wait.begin_request()
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                pass
            first = cpu_wait.own_extension_s()
            second = cpu_wait.own_extension_s()
            os.write(write, f"{first} {second}".encode())
        finally:
            os._exit(0)
    os.close(write)
    first, second = (float(x) for x in os.read(read, 100).split())
    os.waitpid(pid, 0)
    # it waited about 1.1 s of the 1.5: the budget (1 s) is all it gets, and nothing is left for a second timeout
    assert (first, second) == (cpu_wait.OWN_BUDGET_S, 0.0)


def _descendants(pid: int) -> list:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(child) for child in f.read().split()]

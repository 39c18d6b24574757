"""The program runner: hands each slot's socket to a monitor that runs the programs its reward code asks for.

A template forks one runner before it imports the reward (docker backend: as root holding SETUID, SETGID and KILL,
like the template itself). Each slot process the template starts gets one end of a fresh socket pair, the runner
the other, with the slot's index: the runner knows which run uid and scratch directory belong to that socket, so
nothing a slot process says can choose them. When a slot's socket first has a request, the runner forks a monitor
for it (:mod:`.monitor`), which serves that socket's requests one after another until it closes; a slot's next
monitor starts only after the last one ended, so two never share a run uid. A slot's new process asks
(:func:`.run_requests.release`) before any reward code runs in it, and the runner answers once the last
monitor ended: nothing its last process left at the runner is left then. Standard library only.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import sys
from typing import Optional

from ..processes import tree
from .run_requests import RELEASE, encode_frame
from . import monitor
from .program import RunSlot, prepare_filter


_RELEASE_FRAME = encode_frame({"op": RELEASE})


class Runner:
    """One per template: hands each slot socket with a request to a monitor, one monitor per slot at a time."""

    def __init__(self, control: socket.socket, slot_map: dict):
        self.control = control
        self.slots = slot_map  # index -> RunSlot
        self.sockets: dict = {}  # index -> the current slot process's socket, while no monitor has it
        self.busy: dict = {}  # monitor pid -> index
        self.selector = selectors.DefaultSelector()

    def run(self) -> None:
        tree.set_name("rbx-runner")
        wake_r = tree.sigchld_wakeup()
        self.selector.register(wake_r, selectors.EVENT_READ, "wake")
        self.selector.register(self.control, selectors.EVENT_READ, "control")
        while True:
            for key, _ in self.selector.select():
                if key.data == "wake":
                    os.read(wake_r, 4096)
                    self._reap()
                elif key.data == "control":
                    if not self._from_template():
                        return
                else:
                    self._start(key.data)

    def _from_template(self) -> bool:
        from ..protocol.channel import ChannelClosed, optional_fd, recv

        try:
            message, fds = recv(self.control)
        except (ChannelClosed, OSError, ValueError):
            return False
        fd = optional_fd(fds)
        index = message.get("slot")
        if fd is None or index not in self.slots:
            if fd is not None:
                os.close(fd)
            return True
        old = self.sockets.pop(index, None)
        if old is not None:
            self.selector.unregister(old)
            monitor.let_go(old)
        sock = socket.socket(fileno=fd)
        sock.setblocking(True)
        self.sockets[index] = sock
        busy = [pid for pid, i in self.busy.items() if i == index]
        if not busy:
            self.selector.register(sock, selectors.EVENT_READ, index)
        for pid in busy:
            # The template forks a slot's next process only once the last one is gone: whatever its monitor still
            # serves (a socket another process holds open, or reads slowly) has no caller. It kills its program and
            # ends, and the new socket is served once it is reaped.
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        return True

    def _start(self, index: int) -> None:
        sock = self.sockets[index]
        try:
            first = sock.recv(len(_RELEASE_FRAME), socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        except OSError:
            first = b""
        if first == _RELEASE_FRAME:
            # A slot's new process asks before any reward code runs in it (slot._released). Its socket is read
            # only once the slot's last monitor ended (_reap): nothing its last process left here is left.
            try:
                sock.recv(len(first))
                sock.sendall(_RELEASE_FRAME)
            except OSError:
                pass
            return  # its first request starts a monitor
        self.sockets.pop(index)
        self.selector.unregister(sock)
        if not first:
            # The slot process is gone without asking for a program (most never do): no monitor, as nothing of
            # the run uid can exist that a monitor did not start and clean up after.
            sock.close()
            return
        keep = [self.control.fileno(), *(s.fileno() for s in self.sockets.values())]
        try:
            pid = monitor.start(self.slots[index], sock, tuple(keep))
        except OSError:  # the pids limit: the caller sees its socket close and reports it
            sock.close()
            return
        sock.close()
        self.busy[pid] = index

    def _reap(self) -> None:
        for pid, _ in tree.exited_children():
            index = self.busy.pop(pid, None)
            if index is not None and index in self.sockets:  # the slot's next process waited for this one
                self.selector.register(self.sockets[index], selectors.EVENT_READ, index)


def start(slot_map: dict) -> tuple:
    """Forks a runner for ``slot_map`` (index -> RunSlot). Returns (pid, the template's end of its socket)."""
    from ..protocol.channel import pair

    template_end, runner_end = pair()

    def serve() -> None:
        keep = runner_end.fileno()
        os.closerange(3, keep)
        os.closerange(keep + 1, 65536)
        prepare_filter()
        Runner(runner_end, slot_map).run()  # if it raises, the template sees the socket close: run() calls fail

    pid = tree.fork_child(serve)
    runner_end.close()
    return pid, template_end


def main(argv: Optional[list] = None) -> int:
    """``python -m rewardbox.sandbox.programs.runner FD``: serves one socket outside any sandbox (plain Python, the
    in-process backend), in a temporary directory, as the caller's own user."""
    fd = int((argv if argv is not None else sys.argv[1:])[0])
    tree.become_subreaper()
    tree.die_with_parent()
    import tempfile  # here: it loads random, whose reseeding would run after every fork of a template

    with tempfile.TemporaryDirectory(prefix="rbx-run-") as directory:
        slot = RunSlot(uid=None, directory=os.path.join(directory, "scratch"))
        prepare_filter()
        return monitor.Monitor(slot, socket.socket(fileno=fd)).loop()


if __name__ == "__main__":
    sys.exit(main())

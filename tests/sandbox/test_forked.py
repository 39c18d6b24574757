"""How a slot process sends a forked unit's answer (``rewardbox.sandbox.processes.forked.send_with_trailer``), on real
sockets. The server closes a request's socket as soon as it has read the last unit's answer and trailer; the template
may then give that slot process the next request at once. The forked samples themselves, in real containers:
tests/docker/test_sample_isolation.py and tests/docker/test_hostile.py."""

from __future__ import annotations

import socket
import threading

import pytest

from rewardbox.sandbox.processes import forked


class _ServerReadsAndCloses(socket.socket):
    """The slot's end of a request socket whose server reads what one ``sendmsg`` carried and closes its end before
    the slot process runs again (what a busy machine does to the slot process between two system calls)."""

    def __init__(self, fileno: int, server: socket.socket):
        super().__init__(fileno=fileno)
        self.server, self.read = server, b""

    def sendmsg(self, *args, **kwargs):
        sent = super().sendmsg(*args, **kwargs)
        while len(self.read) < sent:
            self.read += self.server.recv(1 << 16)
        self.server.close()
        return sent


@pytest.mark.parametrize("answer", [b"RBX1" + b"a" * 60, memoryview(b"RBX1" + b"b" * 60)])
def test_nothing_is_written_after_the_trailer_so_a_server_that_closes_on_reading_it_ends_nothing(answer):
    slot_end, server = socket.socketpair()
    sock = _ServerReadsAndCloses(slot_end.detach(), server)
    try:
        # Before the fix an empty write followed the trailer: EPIPE, which killed the slot process (SIGPIPE) while
        # the template was handing it the next request.
        forked.send_with_trailer(sock, answer, b"C")
        assert sock.read == bytes(answer) + b"C"
    finally:
        sock.close()


def test_an_answer_larger_than_the_socket_takes_at_once_arrives_whole_with_its_trailer():
    slot_end, server = socket.socketpair()
    slot_end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    answer = bytes(range(256)) * 4096  # 1 MiB: sendmsg takes part of it
    received = bytearray()
    reader = threading.Thread(target=lambda: [received.extend(c) for c in iter(lambda: server.recv(1 << 16), b"")])
    reader.start()
    try:
        forked.send_with_trailer(slot_end, memoryview(answer), b"M\x00")
    finally:
        slot_end.close()
        reader.join(10)
        server.close()
    assert bytes(received) == answer + b"M\x00"

"""The server's reading of a forked request's stream (:mod:`rewardbox.sandbox.protocol.codec`), against a template peer
that speaks the real control channel and stream format and stops where a real slot process can be stopped: the pool's
own code (``FunctionPool``) reads it over real sockets."""

from __future__ import annotations

import asyncio
import mmap
import socket
import threading

import pytest

from rewardbox.sandbox.protocol import codec, stream
from rewardbox.sandbox.protocol.channel import ChannelClosed, pair, recv, send
from rewardbox.sandbox.server.pools import FunctionPool
from rewardbox.sandbox.protocol.records import SampleBatch, WorkerConfig
from rewardbox.wire import Outcome, Status

CONFIG = WorkerConfig(name="peer", filename="peer.py", source="", function="f", style="sample", isolation="sample",
                      workers=1, concurrency=1, max_log_bytes=4096, warm=1)


def _read_request(sock: socket.socket) -> codec.Request:
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    body = mmap.mmap(-1, len(data) - codec.SIZE_BYTES)
    body[:] = data[codec.SIZE_BYTES:]
    return codec.Request(body)


def _template(sock: socket.socket, cut_after: int, served: list, tail: bytes = b"") -> None:
    """Says it loaded a forking function, then serves each request as a forking slot process does: each unit's
    answer (its completion's length) and its CLEAN trailer. In the first request, after the answer of unit
    ``cut_after`` the slot process sends ``tail`` instead of its trailer and ends (as when the kernel kills it
    there)."""
    send(sock, {"op": "loaded", "forks": True, "info": {
        "is_async": False, "accepted_keywords": [], "accepts_var_keywords": False, "signature": "(prompt, completion, "
        "example)", "required_keywords": []}})
    first = True
    while True:
        try:
            message, fds = recv(sock)
        except (ChannelClosed, OSError):
            return
        if message.get("op") != "run":
            continue
        with socket.socket(fileno=fds[0]) as request_sock:
            request = _read_request(request_sock)
            request_sock.sendall(stream.Marker.STARTED + stream.Marker.FORKING)
            for k in range(len(request)):
                completion = request.take([k]).completions[0]
                served.append(completion)
                answer = codec.encode_result([Outcome.ok(float(len(completion)))], "", 0, 4096, 0.001)
                if first and k == cut_after:
                    request_sock.sendall(answer + tail)
                    break
                request_sock.sendall(answer + stream.Marker.CLEAN)
            request.close()
        first = False


@pytest.mark.parametrize("tail", [b"", b"X", bytes(stream.Marker.RETIRE) + b"\x01", stream.Marker.WAITED],
                         ids=["nothing", "a byte no trailer starts with", "half a retire marker", "a WAITED marker"])
def test_a_slot_process_that_ends_between_an_answer_and_its_trailer_blames_no_sample(tail):
    """The answer came whole (the unit's processes were gone and its /tmp emptied before it was sent): the unit keeps
    its score, the units after it were never started and are scored by the next process, nobody gets a crash or an
    invalid (the server used to blame the next unit, and raised IndexError when the cut came after the request's
    last unit), whatever the slot process sent or did not send where the trailer belongs."""
    for cut_after in (1, 3):  # in the middle of the request; after its last unit
        completions = ["a", "bb", "ccc", "dddd"]
        ours, theirs = pair()
        served: list = []
        peer = threading.Thread(target=_template, args=(theirs, cut_after, served, tail), daemon=True)
        peer.start()

        async def score():
            async def spawn(config):
                return ours, 1

            pool = await FunctionPool.start(CONFIG, spawn, 10.0)
            try:
                n = len(completions)
                batch = SampleBatch(["p"] * n, completions, ["{}"] * n, [""] * n, [""] * n, None)
                return await pool.score(batch, 5.0, None)
            finally:
                pool.close()

        result = asyncio.run(score())
        peer.join(5)
        theirs.close()
        assert result.statuses == [Status.OK] * 4, result.errors
        assert result.values == [1.0, 2.0, 3.0, 4.0]
        # each unit scored once: the cut one is not run again, those after it are run by the next request
        assert sorted(served) == sorted(completions)

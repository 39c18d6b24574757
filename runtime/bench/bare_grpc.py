"""The worker path's floor: a bare gRPC round trip of the same payload over a Unix socket, in the same run.

``python -m rewardbox.bench.bare_grpc SOCKET`` serves our Score RPC from a process of its own, answering every call
with one reply built once (the 64 scores a sandbox would send): what is left of a call is the transport, with none
of rewardbox's work on either side. :func:`round_trips` times the same requests against it, as the bench's (a) does
against a sandbox.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc

from ..scoring.transport import CHANNEL_OPTIONS
from ..wire import GRPC_OPTIONS
from ..wire.pb import reward_pb2 as pb
from ..wire.pb import reward_pb2_grpc as pb_grpc

START_TIMEOUT_S = 30.0


def serve(path: str, samples: int = 64) -> None:
    """Serves Score on ``unix://path`` until killed, with one reply of ``samples`` scores for every call."""
    reply = pb.ScoreResponse(scores=[pb.Score(value=1.0, status=pb.STATUS_OK) for _ in range(samples)])

    class Bare(pb_grpc.RewardSandboxServicer):
        async def Score(self, request: pb.ScoreRequest, context: grpc.aio.ServicerContext) -> pb.ScoreResponse:
            return reply

    async def main() -> None:
        server = grpc.aio.server(options=GRPC_OPTIONS)
        pb_grpc.add_RewardSandboxServicer_to_server(Bare(), server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


def round_trips(samples: list, iterations: int, warmup: int = 20) -> list[float]:
    """Seconds per Score call of ``samples`` to a bare server (:func:`serve`) in a process of its own, after
    ``warmup`` calls, back to back, on a channel with the options the host's own channels use."""
    with tempfile.TemporaryDirectory(prefix="rbx-bare-") as tmp:
        path = str(Path(tmp) / "grpc.sock")
        server = subprocess.Popen([sys.executable, "-m", __name__, path, str(len(samples))],
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        try:
            started = time.monotonic()
            while not os.path.exists(path):
                if server.poll() is not None or time.monotonic() - started > START_TIMEOUT_S:
                    raise RuntimeError(f"the bare gRPC server did not start (exit status {server.poll()})")
                time.sleep(0.01)

            async def calls() -> list[float]:
                async with grpc.aio.insecure_channel(f"unix://{path}", options=CHANNEL_OPTIONS) as channel:
                    stub = pb_grpc.RewardSandboxStub(channel)
                    request = pb.ScoreRequest(function="bare", samples=samples, timeout_s=5.0)
                    times = []
                    for i in range(iterations + warmup):
                        t0 = time.perf_counter()
                        await stub.Score(request, timeout=30.0, wait_for_ready=True)
                        if i >= warmup:
                            times.append(time.perf_counter() - t0)
                    return times

            return asyncio.run(calls())
        finally:
            server.kill()
            server.wait()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 64)

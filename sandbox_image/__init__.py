"""``rewardbox.sandbox``: the reward sandbox, installed in every sandbox image.

The gRPC server (:mod:`.server.server`) that loads reward functions and scores samples in slot processes forked from
a template per function version (:mod:`.server.pools`, :mod:`.processes.template`, :mod:`.processes.slot`), and the
Dockerfile of the sandbox image. It runs inside the Docker
image (docker backend) or as a local subprocess (local backend) and depends only on grpcio, grpcio-health-checking,
grpcio-reflection, protobuf and :mod:`rewardbox.wire`: all the sandbox image installs besides the user's
packages. The host never imports it.

Reward code imports :func:`run` and :func:`run_tests` from here to execute model-written programs
(:mod:`.programs.execution`).
"""

from ..wire import VERSION as __version__
from .programs.execution import LANGUAGES, RunnerUnavailable, RunResult, TestsResult, run, run_tests

__all__ = ["LANGUAGES", "RunResult", "RunnerUnavailable", "TestsResult", "__version__", "run", "run_tests"]

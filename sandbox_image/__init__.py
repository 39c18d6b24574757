"""``rewardbox.sandbox``: the reward sandbox, installed in every sandbox image.

The gRPC server (:mod:`.server`) that loads reward functions and scores samples in worker processes
(:mod:`.pools`, :mod:`.worker`), and the Dockerfile of the sandbox image. It runs inside the Docker image (docker
backend) or as a local subprocess (local backend) and depends only on grpcio, grpcio-health-checking,
grpcio-reflection, protobuf, pebble and :mod:`rewardbox.wire`: all the sandbox image installs besides the user's
packages. The host never imports it.
"""

from ..wire import VERSION as __version__

__all__ = ["__version__"]

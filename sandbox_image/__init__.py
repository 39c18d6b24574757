"""The reward sandbox: the gRPC server that runs reward functions in worker processes.

Runs inside the Docker image (docker backend) or as a local subprocess (local backend). Depends only on grpcio,
grpcio-health-checking, grpcio-reflection, protobuf and pebble, which is all the sandbox image installs besides
the user's packages.
"""

__version__ = "0.1.0"

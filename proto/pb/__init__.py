"""Generated gRPC stubs for ``proto/rewardbox/v1/reward.proto``. Do not edit: run ``python -m rewardbox.wire.protogen``."""

from . import reward_pb2, reward_pb2_grpc

__all__ = ["reward_pb2", "reward_pb2_grpc"]

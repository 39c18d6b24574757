"""`rewardbox serve`: one authenticated gRPC endpoint in front of a config's sandboxes."""

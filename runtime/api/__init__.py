"""What a training script calls: sandboxed rewards, tools and environments, the session that starts a config's
sandboxes, and the same rewards in-process."""

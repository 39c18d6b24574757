"""The run record (every completion, score and tool call of a run) and `rewardbox report`, the local web app over it."""

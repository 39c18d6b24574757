"""Model-written programs that reward code runs: the runner, its monitors, the languages."""

"""`rewardbox bench`: the figures behind the speed and memory targets, measured in one run."""

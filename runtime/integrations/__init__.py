"""Adapters that let other RL frameworks score with rewardbox sandboxes (:mod:`rewardbox.integrations.verl`)."""

"""``python -m rewardbox ...``: the same as the ``rewardbox`` command."""

from .cli import main

if __name__ == "__main__":
    main()

"""``python -m rewardbox.trainer CONFIG.yaml [--section.key VALUE ...]``: the same as ``rewardbox train``."""

import sys

from ..cli import app

if __name__ == "__main__":
    sys.exit(app(["train", *sys.argv[1:]], prog_name="python -m rewardbox.trainer"))

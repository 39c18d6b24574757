"""Generates the gRPC stubs in ``rewardbox/wire/pb`` (``proto/pb`` in the repository) from
``rewardbox/v1/reward.proto``.

Run ``python -m rewardbox.wire.protogen`` after editing the .proto file; ``tests/wire/test_protogen.py`` fails when
the committed stubs differ from what this produces. Needs ``grpcio-tools`` (the ``dev`` extra), which the sandbox
image itself never does.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # the include root: it holds rewardbox/v1/reward.proto
PROTO_FILE = "rewardbox/v1/reward.proto"
OUT_DIR = PROTO_ROOT / "pb"
GENERATED = ("reward_pb2.py", "reward_pb2.pyi", "reward_pb2_grpc.py")


def generate() -> dict[str, str]:
    """Returns the generated stub files' texts by file name.

    Raises:
        RuntimeError: protoc rejected the .proto file.
    """
    from grpc_tools import protoc  # dev-only dependency

    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "protoc",
            f"-I{PROTO_ROOT}",
            f"-I{Path(protoc.__file__).parent / '_proto'}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            str(PROTO_ROOT / PROTO_FILE),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO_ROOT / PROTO_FILE}")
        out = Path(tmp) / "rewardbox" / "v1"
        # protoc writes absolute imports (`from rewardbox.v1 import reward_pb2`); the stubs live in
        # rewardbox.wire.pb, so make them relative.
        return {
            name: re.sub(r"^from rewardbox\.v1 import", "from . import", (out / name).read_text(), flags=re.M)
            for name in GENERATED
        }


def main() -> int:
    OUT_DIR.mkdir(exist_ok=True)
    for name, text in generate().items():
        (OUT_DIR / name).write_text(text)
    print(f"wrote {', '.join(GENERATED)} to {OUT_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The ``local`` backend: the sandbox server as a plain subprocess of this Python. No isolation: for trusted code
and machines without Docker, chosen only explicitly (``sandbox.backend: local``). Only the environment variables a
reward names in ``secrets`` reach it, as with Docker."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from ..errors import BackendError
from ..registry import BackendType
from ..scoring.transport import Endpoint
from ..spec import RewardSpec
from .base import BackendSettings, reward_environment

log = logging.getLogger("rewardbox")

# What the server needs to run this Python as the trainer does (PYTHONPATH: rewardbox may be importable through it).
_BASE_ENV = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "SYSTEMROOT", "PYTHONPATH")
SERVER_MODULE = "rewardbox.sandbox"
NOT_ISOLATED_WARNING = (
    "rewardbox: the LOCAL backend runs reward code WITHOUT ISOLATION, as this user, with this machine's network "
    "and files. Use it for trusted code only; the docker backend isolates it."
)


class LocalSettings(BackendSettings):
    """``sandbox.local:``: nothing to set yet; rewards run with this Python and its installed packages."""


class LocalSandbox:
    def __init__(self, name: str, env: dict[str, str]):
        self.name = name
        self._env = env
        self._dir = Path(tempfile.mkdtemp(prefix="rbx-"))  # short: Unix socket paths are limited to 107 bytes
        self._proc: Optional[subprocess.Popen] = None
        self._log_path = self._dir / "server.log"

    @property
    def endpoint(self) -> Endpoint:
        return Endpoint(f"unix://{self._dir / 'grpc.sock'}")

    def start(self) -> None:
        state_dir = self._dir / "state"
        state_dir.mkdir(exist_ok=True)
        env = {**self._env, "PYTHONUNBUFFERED": "1", "REWARDBOX_STATE_DIR": str(state_dir),
               "REWARDBOX_BACKEND": "local"}
        with open(self._log_path, "ab") as out:
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-m", SERVER_MODULE, "--listen", self.endpoint.target,
                     "--parent-pid", str(os.getpid())],
                    env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                    start_new_session=True,  # Ctrl-C reaches the trainer, which then stops us in order
                )
            except OSError as e:
                raise BackendError(f"sandbox {self.name}: cannot start {sys.executable}: {e}") from e

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
                os.killpg(proc.pid, signal.SIGCONT)  # a stopped (frozen) server only sees SIGTERM once continued
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=5)
        # The supervisor and templates are in the server's process group; slot processes (sessions of their own)
        # die with their template (PR_SET_PDEATHSIG on this backend).

    def restart(self) -> None:
        self._kill()
        self.start()

    def stop(self) -> None:
        self._kill()
        shutil.rmtree(self._dir, ignore_errors=True)

    def logs(self, tail: int = 40) -> str:
        try:
            return "\n".join(self._log_path.read_text(errors="replace").splitlines()[-tail:])
        except OSError:
            return ""

    def pid(self) -> Optional[int]:
        return self._proc.pid if self._proc else None


class LocalBackend:
    name = "local"
    isolated = False

    def __init__(self, settings: Optional[LocalSettings] = None):
        self.settings = settings or LocalSettings()
        log.warning(NOT_ISOLATED_WARNING)

    def prepare(self, rewards: Sequence[RewardSpec]) -> None:
        for r in rewards:
            if r.packages:
                log.warning("reward %r: local backend does not install packages %s; they must already be "
                            "importable by %s", r.name, r.packages, sys.executable)

    def create(self, reward: RewardSpec, replica: int) -> LocalSandbox:
        env = {k: os.environ[k] for k in _BASE_ENV if k in os.environ}
        return LocalSandbox(f"{reward.name}-{replica}", {**env, **reward_environment(reward)})

    def close(self) -> None:
        pass


BACKEND = BackendType(
    name="local",
    settings_type=LocalSettings,
    create=LocalBackend,
    isolated=False,
    summary="the sandbox server as a subprocess of this Python; NO isolation (trusted code only)",
)

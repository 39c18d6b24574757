"""rewardbox's exception types: every failure a user sees is one of these, with a message that names the reward,
the file or package, and what to do."""

from pathlib import Path


class RewardboxError(Exception):
    """Root of rewardbox's errors."""


class ConfigError(RewardboxError):
    """The config file is unusable: unknown key, bad value, missing reward file."""


class RewardLoadError(RewardboxError):
    """A reward function cannot be loaded: syntax or import error, missing function, wrong signature."""


class BackendError(RewardboxError):
    """A sandbox could not be started, reached or stopped (engine missing, never became healthy)."""


class ImageBuildError(RewardboxError):
    """A sandbox image could not be built: a package that does not exist or has no build for the image."""


class TransportError(RewardboxError):
    """An RPC to a sandbox failed. ``code`` is the gRPC status code (``grpc.StatusCode``): the client decides on
    it (transient or not), never on the message text."""

    def __init__(self, code, details: str = ""):
        super().__init__(f"{code.name}: {details}" if details else code.name)
        self.code = code
        self.details = details


class ImagePushError(RewardboxError):
    """An image could not be pushed: the registry did not answer or refused it (the registry and image named)."""


def read_named_file(path: Path, what: str) -> bytes:
    """The bytes of a file a setting or option names (``what``: how the user wrote it, e.g. ``--tls-cert`` or
    ``sandbox.remote.tls_ca``).

    Raises:
        ConfigError: it cannot be read, naming ``what``, the path and why.
    """
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{what}: cannot read {path}: {e.strerror}") from None

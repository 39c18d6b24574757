"""Shared services for the remote tests: real ``rewardbox serve`` processes on loopback (their sandboxes on the
local backend, which keeps these tests quick; the docker backend behind a service is the quickstart's), TLS
certificates made by trustme, and client configs with ``backend: remote``."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import pytest
import yaml

from rewardbox import RewardSandboxes, load_config

TOKEN = "test-token-5f2a"
TOKEN_ENV = "RBX_TEST_TOKEN"


@dataclass
class Certificates:
    ca: Path
    cert: Path
    key: Path
    other_ca: Path  # a CA that signed nothing the services use
    client_cert: Path  # a trainer's client certificate, signed by ca (for services with --tls-client-ca)
    client_key: Path
    other_client_cert: Path  # a client certificate signed by another CA
    other_client_key: Path


@pytest.fixture(scope="session")
def certs(tmp_path_factory) -> Certificates:
    import trustme

    folder = tmp_path_factory.mktemp("tls")
    ca = trustme.CA()
    issued = ca.issue_cert("localhost", "127.0.0.1")
    ca.cert_pem.write_to_path(str(folder / "ca.pem"))
    issued.private_key_pem.write_to_path(str(folder / "server.key"))
    (folder / "server.pem").write_bytes(b"".join(p.bytes() for p in issued.cert_chain_pems))
    other = trustme.CA()
    other.cert_pem.write_to_path(str(folder / "other-ca.pem"))
    for name, issuer in (("client", ca), ("other-client", other)):
        issued = issuer.issue_cert(f"{name}.trainers.example")
        issued.private_key_pem.write_to_path(str(folder / f"{name}.key"))
        (folder / f"{name}.pem").write_bytes(b"".join(p.bytes() for p in issued.cert_chain_pems))
    return Certificates(folder / "ca.pem", folder / "server.pem", folder / "server.key", folder / "other-ca.pem",
                        folder / "client.pem", folder / "client.key", folder / "other-client.pem",
                        folder / "other-client.key")


@dataclass
class Service:
    proc: subprocess.Popen
    port: int
    output: list = field(default_factory=list)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    pump: Optional[threading.Thread] = None

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Signals the service and waits for it to exit and for its last output lines to be read."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=60)
        if self.pump is not None:
            self.pump.join(timeout=10)


def write_rewards(folder: Path, rewards: list[dict]) -> list[dict]:
    """Writes each reward's ``code`` to folder/rewards/<name>.py; returns the config entries."""
    (folder / "rewards").mkdir(parents=True, exist_ok=True)
    entries = []
    for r in rewards:
        r = dict(r)
        (folder / "rewards" / f"{r['name']}.py").write_text(textwrap.dedent(r.pop("code")))
        entries.append({"source": f"rewards/{r['name']}.py", **r})
    return entries


def launch_service(command: list, env: dict, timeout_s: float = 60) -> Service:
    """Runs ``command`` (a ``rewardbox serve`` listening on 127.0.0.1:0) and waits for its "serving ... on" line.
    The caller kills it."""
    env = {**env, "COLUMNS": "400"}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue = queue.Queue()
    service = Service(proc, 0)

    def pump():
        for line in proc.stdout:
            service.output.append(line)
            lines.put(line)

    service.pump = threading.Thread(target=pump, daemon=True)
    service.pump.start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.5)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        found = re.search(r" on 127\.0\.0\.1:(\d+) ", line)
        if found:
            service.port = int(found.group(1))
            return service
    service.kill()
    pytest.fail("rewardbox serve did not start:\n" + "".join(service.output))


@pytest.fixture
def serve(tmp_path):
    """serve(rewards, tls=None|Certificates, token=None, name="a", sandbox=None, extra=(), mutual=False) -> a
    running Service (its sandboxes on the local backend unless ``sandbox`` says otherwise; ``extra``: more options;
    ``mutual``: clients need a certificate of ``tls.ca``); all stopped afterwards."""
    services = []

    def start(rewards: list[dict], tls: Optional[Certificates] = None, token: Optional[str] = None,
              name: str = "a", sandbox: Optional[dict] = None, extra: tuple = (), mutual: bool = False) -> Service:
        folder = tmp_path / f"service-{name}"
        entries = write_rewards(folder, rewards)
        sandbox = sandbox or {"backend": "local"}
        (folder / "rewardbox.yaml").write_text(yaml.safe_dump({"sandbox": sandbox, "rewards": entries}))
        command = [sys.executable, "-m", "rewardbox", "serve", str(folder / "rewardbox.yaml"),
                   "--listen", "127.0.0.1:0", "--token-env", TOKEN_ENV]
        if tls is not None:
            command += ["--tls-cert", str(tls.cert), "--tls-key", str(tls.key)]
            if mutual:
                command += ["--tls-client-ca", str(tls.ca)]
        command += list(extra)
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        if token is not None:
            env[TOKEN_ENV] = token
        service = launch_service(command, env)
        services.append(service)
        return service

    yield start
    for service in services:
        service.kill(signal.SIGTERM)


@pytest.fixture
def client(tmp_path, monkeypatch):
    """client(rewards, endpoints, tls_ca=None, token=None, name="client", **remote) -> started RewardSandboxes with
    backend: remote (its own copy of the reward files); all stopped afterwards."""
    started = []

    def start(rewards: list[dict], endpoints: list[str], tls_ca: Optional[Path] = None, token: Optional[str] = None,
              name: str = "client", **remote) -> RewardSandboxes:
        folder = tmp_path / name
        entries = write_rewards(folder, rewards)
        section = {"endpoints": endpoints, **remote}
        if tls_ca is not None:
            section["tls_ca"] = str(tls_ca)
        if token is not None:
            monkeypatch.setenv(TOKEN_ENV, token)
            section["token_env"] = TOKEN_ENV
        sandbox = {"backend": "remote", "remote": section, "backoff_initial_s": 0.05, "backoff_max_s": 0.5}
        (folder / "rewardbox.yaml").write_text(yaml.safe_dump({"sandbox": sandbox, "rewards": entries}))
        s = RewardSandboxes(load_config(folder / "rewardbox.yaml"))
        started.append(s)
        s.start()
        return s

    yield start
    for s in started:
        s.stop()

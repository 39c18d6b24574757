"""The Kubernetes pod's two halves, run here with a real container in place of the pod: the sandbox server as
`rewardbox deploy kubernetes` starts it (slot directories made under one world-writable directory, as an emptyDir
is, with ``--slot-root``), and ``rewardbox serve`` attached to its socket (``backend: attached``), as the pod's
gateway container runs it. What a cluster adds (the kubelet, the pod's security context, NetworkPolicy) is not
here: the manifests are schema-checked in tests/host/test_kubernetes.py."""

from __future__ import annotations

import asyncio

import pytest

from rewardbox import build_samples
from rewardbox.backends.containers import LABEL, ContainerSpec, DockerSandbox
from rewardbox.images.image import ImageBuilder
from tests.remote.conftest import TOKEN

pytestmark = pytest.mark.docker

PROBE = """
import os, stat
from rewardbox.sandbox import run

def probe(prompt, completion, example):
    here = os.getcwd()
    info = os.stat(here)
    parent = os.stat("/scratch")
    found = sorted(os.listdir(here))
    open("mine", "w").write(prompt)
    try:
        open("/scratch/planted", "w").write("x")
        planted = True
    except OSError:
        planted = False
    others = [d for d in os.listdir("/scratch") if d != os.path.basename(here)] if parent.st_mode & 0o004 else []
    # a program it runs: under the slot's run uid, in that uid's own directory under /scratch
    program = run("import os\\nprint(os.getuid(), os.getcwd(), sorted(os.listdir('.')))").stdout.split(" ", 2)
    ok = (here == f"/scratch/slot-{os.getuid()}" and info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) == 0o700
          and stat.S_IMODE(parent.st_mode) == 0o711 and parent.st_uid == 0 and not found and not planted
          and not others and program[0] != str(os.getuid()) and program[1] == f"/scratch/slot-{program[0]}"
          and program[2] == "['main.py']\\n")
    print(here, oct(info.st_mode), oct(parent.st_mode), found, planted, program)
    return 1.0 if ok else 0.0
"""


def test_a_pods_sandbox_container_and_its_gateway_serve_with_per_sample_scratch(docker_client, base_image, serve,
                                                                                  client, certs):
    image = ImageBuilder(docker_client).ensure(base_image, [])
    spec = ContainerSpec(image=image, name=f"rewardbox-podtest-{id(image) % 100000}", slot_uids=(20000, 16),
                         slot_root="/scratch", labels={LABEL: "1"}, pids_limit=256, mem_limit="512m",
                         default_warm=4, sample_nproc=16)
    sandbox = DockerSandbox(docker_client, spec)
    sandbox.start()
    try:
        # the gateway as `rewardbox deploy kubernetes --client-certificates` runs it: mutual TLS and a token
        service = serve([{"name": "probe", "code": PROBE, "workers": 2, "warm": 4}], tls=certs, token=TOKEN,
                        sandbox={"backend": "attached", "attached": {"target": sandbox.endpoint.target}}, mutual=True)
        s = client([{"name": "probe", "code": PROBE}], [service.target], tls_ca=certs.ca, token=TOKEN,
                   tls_client_cert=str(certs.client_cert), tls_client_key=str(certs.client_key))
        for _ in range(3):  # more samples than slots: every uid serves several samples in turn
            report = asyncio.run(s["probe"].client.score(build_samples([str(i) for i in range(24)], ["c"] * 24, {})))
            assert report.statuses == ["ok"] * 24, [e for e in report.errors if e]
            assert report.values == [1.0] * 24, report.logs
    finally:
        sandbox.stop()

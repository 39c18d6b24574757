"""The distribution: a wheel built from the checkout installs into a fresh virtual environment and scores with the
docker backend from an empty directory; it exposes no import name but `rewardbox`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import venv
import zipfile

import pytest

from tests.conftest import ROOT


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    dist = tmp_path_factory.mktemp("dist")
    # setuptools' scratch copy of the last build: after a module moved, its old copy there went into the wheel
    shutil.rmtree(ROOT / "build" / "lib", ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "--wheel-dir", str(dist),
                           str(ROOT)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    [built] = dist.glob("rewardbox-*.whl")
    return built


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory):
    """A fresh virtual environment (no system packages) with only the wheel and its dependencies."""
    root = tmp_path_factory.mktemp("venv")
    venv.create(root, with_pip=True)
    python = root / "bin" / "python"
    proc = subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(wheel)], capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    return python


def test_the_wheel_holds_one_import_package_and_the_sandbox_files(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"rewardbox", f"{wheel.name.split('-py3')[0]}.dist-info"}
    for data in ("rewardbox/sandbox/Dockerfile", "rewardbox/wire/rewardbox/v1/reward.proto",
                 "rewardbox/wire/pb/reward_pb2.py", "rewardbox/wire/pb/reward_pb2.pyi", "rewardbox/py.typed",
                 "rewardbox/Dockerfile.service"):
        assert data in names


# Each source folder and the import package it becomes (pyproject.toml's package-dir)
SOURCE_FOLDERS = {"runtime": "rewardbox", "sandbox_image": "rewardbox/sandbox", "proto": "rewardbox/wire",
                  "trainer": "rewardbox/trainer"}


def test_the_wheel_holds_every_module_of_every_source_folder(wheel):
    # A subpackage missing from pyproject.toml's package list installs nowhere but in an editable checkout
    # (rewardbox.integrations was missing: verl's entry point failed to import from a wheel)
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = []
    for folder, package in SOURCE_FOLDERS.items():
        for module in sorted((ROOT / folder).rglob("*.py")):
            relative = module.relative_to(ROOT / folder)
            if any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
                continue
            if f"{package}/{relative.as_posix()}" not in names:
                missing.append(f"{folder}/{relative.as_posix()}")
    assert not missing, f"not in the wheel (add their packages to pyproject.toml): {missing}"
    sources = {f"{package}/{module.relative_to(ROOT / folder).as_posix()}" for folder, package in SOURCE_FOLDERS.items()
               for module in (ROOT / folder).rglob("*.py")}
    extra = sorted(n for n in names if n.endswith(".py") and n not in sources)
    assert not extra, f"in the wheel without a source file: {extra}"


def test_the_installed_wheel_exposes_only_rewardbox(venv_python, tmp_path):
    for name in ("runtime", "trainer", "sandbox_image"):
        proc = subprocess.run([str(venv_python), "-c", f"import {name}"], capture_output=True, text=True,
                              cwd=tmp_path, timeout=60)
        assert proc.returncode != 0 and f"No module named '{name}'" in proc.stderr
    proc = subprocess.run([str(venv_python), "-c", "import rewardbox, rewardbox.wire.pb.reward_pb2; "
                           "from rewardbox import RewardSandboxes, load_config, SandboxedReward; "
                           "print(rewardbox.__file__)"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert str(venv_python.parent.parent) in proc.stdout  # from the venv, not from the checkout


def test_the_installed_wheel_scores_with_the_docker_backend_from_an_empty_directory(venv_python, tmp_path,
                                                                                   docker_client):
    (tmp_path / "length.py").write_text("def length(prompt, completion, example):\n    return float(len(completion))\n")
    (tmp_path / "rewardbox.yaml").write_text("sandbox:\n  backend: docker\nrewards:\n  - name: length\n"
                                             "    source: length.py\n")  # no base image: auto
    (tmp_path / "s.jsonl").write_text('{"prompt": "p", "completion": "abc"}\n{"prompt": "p", "completion": "ab"}\n')
    rewardbox = venv_python.parent / "rewardbox"
    proc = subprocess.run([str(rewardbox), "score", "rewardbox.yaml", "--samples", "s.jsonl", "--out", "o.jsonl"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [(r["scores"]["length"], r["status"]["length"]) for r in rows] == [(3.0, "ok"), (2.0, "ok")]
    # `python -m rewardbox` is the same command
    proc = subprocess.run([str(venv_python), "-m", "rewardbox", "backends"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60)
    assert proc.returncode == 0 and "docker" in proc.stdout

"""The whole `rewardbox` package type-checks with mypy (the settings in pyproject.toml's [tool.mypy]).

mypy finds a package by its folder, so it runs on build/docs-package/, the package laid out as Python imports it
(docs/hooks/package_tree.py, which the docs build uses for the same reason)."""

from __future__ import annotations

import importlib.util
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TREE = ROOT / "build" / "docs-package"


def test_the_package_type_checks_with_mypy():
    if importlib.util.find_spec("mypy") is None:
        pytest.fail("mypy is missing; run `pip install -e .[dev]`")
    runpy.run_path(str(ROOT / "docs" / "hooks" / "package_tree.py"))  # builds the tree on load
    check = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
         "--cache-dir", str(ROOT / "build" / "mypy-cache"), "-p", "rewardbox"],
        cwd=TREE, capture_output=True, text=True, timeout=540,
    )
    assert check.returncode == 0, f"mypy found errors:\n{check.stdout}{check.stderr}"

"""The documentation: the MkDocs site builds with --strict (no broken link or anchor, no page left out of the
navigation, the Python API renders from the docstrings), and the README stays a front page with the two commands."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 220
README_COMMANDS = ("bash scripts/quickstart.sh", "bash scripts/test.sh")


def test_the_site_builds_with_strict_checks(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}  # material's banner about its successor, printed on every build
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}{build.stderr}"
    api = (tmp_path / "site" / "reference" / "python-api" / "index.html").read_text()
    assert "sandboxed" in api and "RewardSandboxes" in api and "Status" in api  # rendered, not left as ::: lines
    assert ":::" not in api


def test_the_readme_is_a_front_page_with_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    lines = readme.count("\n") + (not readme.endswith("\n"))
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the rest belongs under docs/"
    for command in README_COMMANDS:
        assert f"```bash\n{command}\n```" in readme, f"README.md lost its copy-paste command: {command}"


def test_the_readmes_links_point_at_files_that_exist():
    # GitHub renders the README with links relative to the repository; mkdocs does not check it.
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    assert targets, "no relative links found in README.md"
    missing = [t for t in targets if "://" not in t and not (ROOT / t).exists()]
    assert not missing, f"README.md links to missing files: {missing}"

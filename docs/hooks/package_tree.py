"""MkDocs hook: lays out the `rewardbox` package as Python imports it, for mkdocstrings.

pyproject.toml maps one import package from several folders (`rewardbox` from runtime/, `rewardbox.wire` from
proto/, ...). Griffe, which reads the source for the API reference, finds a package by its folder and knows nothing
of that mapping, so `rewardbox.Status` (defined in `rewardbox.wire`) would not resolve. Before each build this hook
makes build/docs-package/rewardbox/, a folder of symbolic links that nests the mapped folders as their package
names say; mkdocs.yml points the python handler there. Nothing is copied and nothing else reads it.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TREE = ROOT / "build" / "docs-package"


def _mapping() -> dict[str, Path]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        package_dir = tomllib.load(f)["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in package_dir.items()}


def _link(target: Path, link: Path) -> None:
    if link.is_symlink() and os.readlink(link) == str(target):
        return
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(target)


def _sync(package: str, folder: Path, mapping: dict[str, Path]) -> None:
    here = TREE.joinpath(*package.split("."))
    here.mkdir(parents=True, exist_ok=True)
    depth = package.count(".") + 1
    children = {name.rsplit(".", 1)[1] for name in mapping if name.startswith(package + ".") and name.count(".") == depth}
    wanted = {entry.name for entry in folder.iterdir() if entry.name != "__pycache__"} - children
    # (a __pycache__ there is Python's own, where something imported from the tree: not ours to remove)
    for stale in {entry.name for entry in here.iterdir()} - wanted - children - {"__pycache__"}:
        (here / stale).unlink()
    for name in wanted:
        _link(folder / name, here / name)
    for child in children:
        _sync(f"{package}.{child}", mapping[f"{package}.{child}"], mapping)


def _build() -> None:
    mapping = _mapping()
    for top in [name for name in mapping if "." not in name]:
        _sync(top, mapping[top], mapping)


# Made when mkdocs loads this hook, before any plugin's on_config: mkdocstrings reads its handler's `paths` there,
# and a folder missing then is no search path at all (the first build of a fresh clone failed: griffe found
# `rewardbox` through the editable install instead, without its mapped subpackages).
_build()


def on_config(config, **kwargs):
    _build()  # again on every rebuild of `mkdocs serve`: a module added since
    return config

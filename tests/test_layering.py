"""The library's layers: the host never imports the sandbox's internals, the sandbox never imports the host, and
importing the host side starts no process. Checked on the source (every import statement) and by importing."""

from __future__ import annotations

import ast
import subprocess
import sys
import pytest

from rewardbox.images import image
from tests.conftest import ROOT

# repository folder -> its name in the rewardbox namespace
LAYERS = {"runtime": "rewardbox", "sandbox_image": "rewardbox.sandbox", "proto": "rewardbox.wire",
          "trainer": "rewardbox.trainer"}
STDLIB = set(sys.stdlib_module_names)


def imports_of(folder: str) -> list[tuple[str, str]]:
    """(file, absolute module) for every import in a layer's Python files (generated stubs included)."""
    package = LAYERS[folder]
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
        module = ".".join([package, *parts[:-1]] if parts[-1] == "__init__" else [package, *parts])
        here = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [(str(path.relative_to(ROOT)), alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module
                found.append((str(path.relative_to(ROOT)), target))
    return found


def _inside(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


@pytest.mark.parametrize("folder", ["runtime", "trainer"])
def test_the_host_never_imports_the_sandbox(folder):
    offenders = [(f, m) for f, m in imports_of(folder) if _inside(m, "rewardbox.sandbox")]
    assert offenders == []


@pytest.mark.parametrize("folder, allowed", [
    ("sandbox_image", ("rewardbox.sandbox", "rewardbox.wire", "grpc", "grpc_health", "grpc_reflection")),
    # grpc_tools: only the dev-time stub generator (protogen.py), which is not copied into images
    ("proto", ("rewardbox.wire", "grpc", "google.protobuf", "grpc_tools")),
])
def test_the_sandbox_and_the_wire_import_only_themselves_and_their_few_dependencies(folder, allowed):
    offenders = [(f, m) for f, m in imports_of(folder)
                 if m.split(".")[0] not in STDLIB and m != "__future__" and not any(_inside(m, a) for a in allowed)]
    assert offenders == []


def test_the_worker_module_loads_nothing_but_the_standard_library():
    # It is preloaded into the sandbox's fork server: what it imports, every worker carries.
    code = ("import sys; before = set(sys.modules); import rewardbox.sandbox.processes.worker; "
            "print(sorted({m.split('.')[0] for m in set(sys.modules) - before} - set(sys.stdlib_module_names)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['rewardbox']"


def test_the_processes_that_fork_samples_carry_no_module_whose_at_fork_handler_runs_in_every_child(tmp_path):
    # What the sandbox's entry point imports before it forks the supervisor, and the template after, every forked
    # sample carries: threading's and random's at-fork handlers would run in each (threading's writes about 130
    # pages, copied, before the sample's first line), logging loads threading, and shutil (which argparse imports
    # for the terminal's width) maps bz2 and lzma. Laid out as in a sandbox image (the image's own
    # rewardbox/__init__.py), without site-packages.
    package = tmp_path / "rewardbox"
    package.mkdir()
    (package / "__init__.py").write_text(image.IMAGE_INIT)
    (package / "sandbox").symlink_to(ROOT / "sandbox_image")
    (package / "wire").symlink_to(ROOT / "proto")
    code = ("import sys\n"
            "import rewardbox.sandbox.__main__, rewardbox.sandbox.processes.supervisor\n"
            "import rewardbox.sandbox.processes.template, rewardbox.sandbox.processes.slot\n"
            "import rewardbox.sandbox.processes.forked, rewardbox.sandbox.programs.execution\n"
            "rewardbox.sandbox.__main__._parser().parse_args(['--listen', 'unix:///run/x.sock', '--atomic-kill'])\n"
            "print(sorted(m for m in ('threading', 'random', 'logging', 'asyncio', 'shutil', 'bz2', 'lzma', 'grpc')"
            " if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, cwd="/",
                         env={"PYTHONPATH": str(tmp_path), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_importing_the_host_side_loads_no_sandbox_module_and_starts_no_process():
    code = ("import os, sys\n"
            "import rewardbox, rewardbox.cli, rewardbox.api.session, rewardbox.scoring.client\n"
            "import rewardbox.bench.run, rewardbox.images.image\n"
            "import rewardbox.backends.docker, rewardbox.backends.local, rewardbox.trainer\n"
            "from rewardbox import RewardSandboxes, SandboxedReward, load_config, train\n"
            "print(sorted(m for m in sys.modules if m.startswith('rewardbox.sandbox')))\n"
            "print(open(f'/proc/self/task/{os.getpid()}/children').read())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    modules, children = out.stdout.splitlines()
    assert modules == "[]" and children.strip() == ""


def test_the_host_package_imports_in_one_direction():
    """No two modules of the host side import each other, directly or through others, counting imports made only
    for type checking and the package ``__init__`` an import runs (the config model, the backend registry, the
    backends and the image builder each depend in one direction)."""
    package = LAYERS["runtime"]
    modules = {}
    for path in (ROOT / "runtime").rglob("*.py"):
        parts = list(path.relative_to(ROOT / "runtime").with_suffix("").parts)
        modules[".".join([package, *(parts[:-1] if parts[-1] == "__init__" else parts)])] = path
    graph: dict = {}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = here.split(".")[: len(here.split(".")) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
            for imported in [target, *(f"{target}.{alias.name}" for alias in node.names)]:
                parts = imported.split(".")
                for k in range(2, len(parts) + 1):  # importing a.b.c runs a.b's __init__ too
                    module = ".".join(parts[:k])
                    if module in modules and module != name and not name.startswith(module + "."):
                        deps.add(module)

    def cycle_from(start: str) -> list:
        path, seen = [start], set()

        def visit(node: str) -> bool:
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return True
                if nxt not in seen:
                    seen.add(nxt)
                    path.append(nxt)
                    if visit(nxt):
                        return True
                    path.pop()
            return False

        return path if visit(start) else []

    cycles = [cycle_from(name) for name in sorted(graph)]
    assert not any(cycles), [" -> ".join(c + [c[0]]) for c in cycles if c]


def test_the_sandbox_and_service_images_get_every_module_of_the_sandbox_with_its_subpackages():
    from rewardbox.images.image import image_files, service_files

    sandbox = {path.relative_to(ROOT / "sandbox_image").as_posix() for path in (ROOT / "sandbox_image").rglob("*.py")
               if "__pycache__" not in path.parts}
    assert any("/" in name for name in sandbox)  # it has subpackages: the listing must reach into them
    image, service = image_files(), service_files()
    assert {f"sandbox/{name}" for name in sandbox} <= set(image)
    assert {f"sandbox/{name}" for name in sandbox} <= set(service)
    assert all(path.exists() for path in [*image.values(), *service.values()])

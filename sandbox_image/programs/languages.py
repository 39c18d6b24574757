"""The languages :func:`rewardbox.sandbox.run` knows: where the program's source goes, how it is built and run,
and which Debian packages an image needs for it (a reward's ``system_packages``). Standard library only."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class Language:
    name: str
    source: str  # the file the code is written to, in the program's scratch directory
    run: tuple  # argv; "{python}" is this interpreter, "{memory_mb}" the memory limit
    build: Optional[tuple] = None  # argv of the compile step, if any
    artifact: Optional[str] = None  # what the build leaves for every run
    packages: tuple = ()  # Debian packages the image needs (none: the image has it)
    # Address space a runtime reserves without using it (V8 reserves about a gigabyte up front): added to the
    # RLIMIT_AS of the program. The memory it may write to is RLIMIT_DATA = memory_mb either way.
    address_grace_mb: int = 256
    memory_markers: tuple = ()  # stderr text that means an allocation failed
    aliases: tuple = field(default=())

    @property
    def executable(self) -> str:
        return (self.build or self.run)[0]


_OOM = ("std::bad_alloc", "Cannot allocate memory", "out of memory")
LANGUAGES = {language.name: language for language in (
    Language("python", "main.py", ("{python}", "main.py"), memory_markers=("MemoryError",), aliases=("python3", "py")),
    Language("cpp", "main.cpp", ("./main",), build=("g++", "-std=c++17", "-O2", "-pipe", "-o", "main", "main.cpp"),
             artifact="main", packages=("g++",), memory_markers=_OOM, aliases=("c++", "cxx")),
    Language("c", "main.c", ("./main",), build=("gcc", "-std=c11", "-O2", "-pipe", "-o", "main", "main.c", "-lm"),
             artifact="main", packages=("gcc",), memory_markers=_OOM),
    Language("javascript", "main.js", ("node", "--max-old-space-size={memory_mb}", "main.js"), packages=("nodejs",),
             address_grace_mb=4096, memory_markers=("heap out of memory", "Fatal process out of memory",
                                                    "Fatal process OOM", *_OOM), aliases=("js", "node", "nodejs")),
    Language("bash", "main.sh", ("bash", "main.sh"), memory_markers=_OOM, aliases=("sh", "shell")),
)}
_BY_ALIAS = {alias: language for language in LANGUAGES.values() for alias in (language.name, *language.aliases)}


def lookup(name: object) -> Language:
    """The language called ``name`` (or one of its aliases, any case).

    Raises:
        ValueError: unknown, naming the known ones.
    """
    language = _BY_ALIAS.get(str(name).lower())
    if language is None:
        raise ValueError(f"language {name!r} is not one rewardbox.sandbox.run knows; use one of "
                         f"{', '.join(sorted(LANGUAGES))}")
    return language


def missing_tool(language: Language) -> Optional[str]:
    """Why ``language`` cannot run in this image (its compiler or interpreter is not installed), or None."""
    import shutil  # here: it loads bz2 and lzma, whose libraries every fork of a template would copy the maps of

    tool = language.executable
    if tool == "{python}" or shutil.which(tool, path="/usr/local/bin:/usr/bin:/bin"):
        return None
    packages = ", ".join(language.packages) or tool
    return (f"{language.name} needs {tool!r}, which this sandbox image lacks: add `system_packages: [{packages}]` "
            f"to the reward in the config")


def argv(parts: tuple, memory_mb: int) -> list:
    return [sys.executable if p == "{python}" else p.replace("{memory_mb}", str(memory_mb)) for p in parts]

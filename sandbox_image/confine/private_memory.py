"""Shared memory a reward's import left behind becomes private before any sample runs.

A mapping made ``MAP_SHARED`` (``mmap.mmap(-1, n)`` at a module's top level, a library's shared buffer) stays shared
across ``fork``: every slot process and every sample's child forked from the template would write into the same
pages, and one sample could change what later or concurrent samples read there. A fresh process per sample gives
fresh state only if nothing it inherits is shared. So once the reward is imported, and before the template forks
anything, each shared mapping of the template is replaced, at the same address and with the same protection, by a
private copy of its contents (a private anonymous mapping moved there with ``mremap``): each fork then gets its own
copy-on-write pages, as for any other memory. The reward's objects (an ``mmap`` object, a pointer a C library
keeps) still see the same addresses and contents.
"""

from __future__ import annotations

import os
from typing import Iterator

PROT_READ, PROT_WRITE, PROT_EXEC = 1, 2, 4
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS = 0x01, 0x02, 0x10, 0x20
_MREMAP_MAYMOVE, _MREMAP_FIXED = 1, 2
_FAILED = (1 << 64) - 1  # MAP_FAILED as ctypes returns a c_void_p


class SharedMappingError(RuntimeError):
    """A shared mapping could not be made private (the reward's module cannot be scored with fresh state)."""


def _a_file(backing: str) -> bool:
    """Whether a mapping is of a file a name still reaches (a read-only ``np.memmap``, a dataset's Arrow file): copied,
    it would turn reclaimable page cache into anonymous memory, and reading past the file's end raises SIGBUS."""
    return backing.startswith("/") and not backing.endswith("(deleted)") and not backing.startswith("/dev/zero")


def shared_mappings(smaps: str = "/proc/self/smaps") -> Iterator[tuple[int, int, int, str, bool, int, int]]:
    """(start, end, protection, what backs it, whether it may be made writable, file offset, inode) of each shared
    mapping in ``smaps`` but read-only mappings of files that can never be made writable (glibc's gconv cache, a
    read-only ``np.memmap``: see :func:`_a_file`). A read-only mapping of a file the import opened for writing
    (``open(p, "r+b")``, then ``ACCESS_READ``) may be: any fork can ``mprotect`` it writable and write the file's
    pages every later fork reads (red team of #40); ``VmFlags``' ``mw`` says so."""
    header = None
    with open(smaps) as f:
        for line in f:
            if header is None or not line[:1].isupper():  # a mapping's first line (its fields start lowercase/hex)
                fields = line.split(maxsplit=5)
                if "-" in fields[0] and len(fields) >= 5:
                    header = fields
                    continue
            if header is not None and line.startswith("VmFlags:"):
                fields, header = header, None
                perms = fields[1]
                if perms[3] != "s":
                    continue
                start, end = (int(x, 16) for x in fields[0].split("-"))
                prot = (PROT_READ if perms[0] == "r" else 0) | (PROT_WRITE if perms[1] == "w" else 0) | \
                    (PROT_EXEC if perms[2] == "x" else 0)
                backing = fields[5].strip() if len(fields) > 5 else ""
                may_write = "mw" in line.split()[1:]
                if not prot & PROT_WRITE and not may_write and _a_file(backing):
                    continue
                yield start, end, prot, backing, may_write, int(fields[2], 16), int(fields[4])


def _libc():
    import ctypes  # only where a shared mapping is found: every fork of the template would carry it

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mremap.restype = ctypes.c_void_p
    libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _check(ok: bool, what: str, backing: str) -> None:
    if not ok:
        import ctypes

        errno = ctypes.get_errno()
        raise SharedMappingError(f"the reward's import left a shared memory mapping ({backing or 'anonymous'}) that "
                                 f"could not be made private: {what}: {os.strerror(errno)}")


def _remap_read_only(libc, start: int, length: int, prot: int, backing: str, offset: int, inode: int) -> None:
    try:
        fd = os.open(backing, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise SharedMappingError(f"the reward's import mapped {backing} shared from a descriptor open for writing, "
                                 f"and it cannot be opened read-only ({e}): open it read-only (open(path, 'rb')) "
                                 "to map it, or use isolation: worker") from None
    try:
        if os.fstat(fd).st_ino != inode:
            raise SharedMappingError(f"the reward's import mapped {backing} shared from a descriptor open for "
                                     "writing, and that name now names another file: open it read-only "
                                     "(open(path, 'rb')) to map it, or use isolation: worker")
        moved = libc.mmap(start, length, prot, _MAP_SHARED | _MAP_FIXED, fd, offset)
        _check(moved == start, "mmap", backing)
    finally:
        os.close(fd)


def make_private() -> int:
    """Replaces every shared mapping of this process by a private copy (see the module docstring). Returns how many
    it replaced.

    Raises:
        SharedMappingError: one could not be read or replaced.
    """
    found = list(shared_mappings())
    if not found:
        return 0
    import ctypes

    libc = _libc()
    for start, end, prot, backing, may_write, offset, inode in found:
        length = end - start
        if may_write and not prot & PROT_WRITE and _a_file(backing):
            # Read-only, of a file opened for writing (shared_mappings leaves out those that can never be written): the
            # same pages again, from a descriptor opened read-only (no fork can make them writable), at the same
            # address. Still page cache, and still the file's own bytes.
            _remap_read_only(libc, start, length, prot, backing, offset, inode)
            continue
        if not prot & PROT_READ:
            _check(libc.mprotect(start, length, prot | PROT_READ) == 0, "mprotect", backing)
        copy = libc.mmap(None, length, PROT_READ | PROT_WRITE, _MAP_PRIVATE | _MAP_ANONYMOUS, -1, 0)
        _check(copy not in (None, _FAILED), "mmap", backing)
        ctypes.memmove(copy, start, length)
        moved = libc.mremap(copy, length, length, _MREMAP_MAYMOVE | _MREMAP_FIXED, start)
        if moved != start:
            libc.munmap(copy, length)
            _check(False, "mremap", backing)
        _check(libc.mprotect(start, length, prot) == 0, "mprotect", backing)
    return len(found)

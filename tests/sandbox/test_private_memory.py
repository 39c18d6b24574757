"""Shared mappings a reward's import left become private copies before the template forks (sandbox_image/
private_memory.py): what one fork writes there no other fork sees. In containers: tests/docker/test_steady_state.py."""

from __future__ import annotations

import mmap
import os

from rewardbox.sandbox.confine import private_memory


def _written_in_a_child(view: mmap.mmap) -> None:
    pid = os.fork()
    if pid == 0:
        view[:5] = b"child"
        os._exit(0)
    assert os.waitpid(pid, 0)[1] == 0


def test_a_shared_mapping_becomes_private_with_its_contents_and_address():
    shared = mmap.mmap(-1, 3 * mmap.PAGESIZE)
    shared[:6] = b"parent"
    shared[-4:] = b"tail"
    _written_in_a_child(shared)
    assert shared[:5] == b"child"  # shared: the child's write reached this process
    shared[:6] = b"parent"
    assert private_memory.make_private() >= 1
    assert not list(private_memory.shared_mappings())
    assert shared[:6] == b"parent" and shared[-4:] == b"tail"
    _written_in_a_child(shared)
    assert shared[:6] == b"parent"  # private now: the child wrote its own copy
    shared[:6] = b"writes"
    assert shared[:6] == b"writes"
    shared.close()


def _perms(start: int) -> str:
    with open("/proc/self/maps") as f:
        for line in f:
            bounds, perms = line.split()[:2]
            if int(bounds.split("-")[0], 16) == start:
                return perms
    raise AssertionError(f"no mapping starts at {start:#x}")


def test_a_read_only_shared_mapping_keeps_its_protection_and_contents():
    source = mmap.mmap(-1, mmap.PAGESIZE)
    source[:4] = b"data"
    private_memory.make_private()  # source is private from here on
    read_only = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ)
    before = {m[0] for m in private_memory.shared_mappings() if m[2] == private_memory.PROT_READ}
    assert len(before) == 1
    (start,) = before
    assert _perms(start) == "r--s"
    private_memory.make_private()
    assert _perms(start) == "r--p"
    assert read_only[:4] == bytes(4)
    source.close()
    read_only.close()


def test_nothing_to_do_without_shared_mappings():
    private_memory.make_private()
    assert private_memory.make_private() == 0


def test_a_read_only_mapping_of_a_file_is_left_alone_even_past_the_files_end(tmp_path):
    # Copied, a dataset's memory-mapped file would become anonymous memory, and a read past a truncated file's end
    # raises SIGBUS (review of #40).
    path = tmp_path / "data.bin"
    path.write_bytes(b"x" * 2 * mmap.PAGESIZE)
    fd = os.open(path, os.O_RDONLY)
    mapped = mmap.mmap(fd, 2 * mmap.PAGESIZE, prot=mmap.PROT_READ)
    os.close(fd)
    os.truncate(path, 0)
    assert all(str(path) not in m[3] for m in private_memory.shared_mappings())
    private_memory.make_private()  # does not read it (SIGBUS would end this process)
    mapped.close()


def test_a_read_only_mapping_of_a_file_opened_for_writing_is_mapped_again_from_a_read_only_descriptor(tmp_path):
    # Red team of #40: open(p, "r+b") and ACCESS_READ at import; a fork could mprotect the mapping writable (the
    # descriptor allowed it) and write the file's pages every later fork reads.
    import ctypes

    path = tmp_path / "table.bin"
    path.write_bytes(b"\x01" * mmap.PAGESIZE)
    with open(path, "r+b") as f:
        table = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    found = [m for m in private_memory.shared_mappings() if m[3] == str(path)]
    assert len(found) == 1 and found[0][4], found  # it may be made writable
    start = found[0][0]
    private_memory.make_private()
    assert not [m for m in private_memory.shared_mappings() if m[3] == str(path)]  # now it may not
    assert _perms(start) == "r--s" and table[:1] == b"\x01"  # the same file's pages, at the same address
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    pid = os.fork()
    if pid == 0:
        refused = libc.mprotect(start, mmap.PAGESIZE, private_memory.PROT_READ | private_memory.PROT_WRITE) != 0
        os._exit(0 if refused else 1)
    assert os.waitpid(pid, 0)[1] == 0  # a fork cannot make it writable any more
    assert path.read_bytes()[:1] == b"\x01"
    table.close()

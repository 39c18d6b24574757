"""What a sandbox's memory use is, and what its processes hold: the figures the memory guard (:mod:`.memory_guard`)
decides on, read and nothing more.

:class:`Usage` is how much of the limit is in use that the kernel cannot give back: the memory cgroup's usage less
its file cache (v1 or v2; v2 less reclaimable slab too, the dentries a sample can make by the million); under cgroup
v1, the kernel memory in it apart (:meth:`Usage.kernel`); under gVisor, which has no cgroup files, ``/proc/meminfo``
(whose total is the container's limit) plus SOCKET_BYTES for each socket of the sandbox (its kernel's socket buffers
are in no figure there). One number is read at every poll, from descriptors kept open (under gVisor, a tenth of the
cost of opening the files each time).

:func:`held` adds up, per slot, what its processes hold from their ``/proc/<pid>/status``: resident anonymous and
shared memory, page tables, and what their sockets hold (:mod:`.sockets`), with the program runner's monitor that
serves a slot counted for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterable, NamedTuple, Optional

from ..processes import tree
from . import sockets

_MIB = 1 << 20
MIN_MARGIN_BYTES = 32 * _MIB
# The guard acts at limit - limit / fraction: an eighth below it with a memory cgroup, a quarter from /proc/meminfo
# (gVisor: the host counts more than gVisor shows while memory churns, and gVisor gives a killed sample's memory
# back over hundreds of milliseconds; polling every 50 ms, 12 forks of 80 MiB each took a 1 GiB sandbox down in some
# runs even at a quarter; polling every 10 ms from descriptors kept open, none did in 5. A third killed two
# innocents of 280 MiB each, within their budget, beside each other.)
CGROUP_MARGIN_FRACTION = 8
MEMINFO_MARGIN_FRACTION = 4
MAX_INTERVAL_S = 0.05  # the longest the guard sleeps between two reads (a fifth of it under gVisor)
# Under gVisor, where nothing says what a socket queues, each socket counts as SOCKET_BYTES: the default send buffer
# (net.core.wmem_default, 208 KiB) and the skb overhead (measured under runc: a filled socket pair held about 470 KB).
SOCKET_BYTES = 240 << 10
MONITOR_NAME = b"rbxm-"  # monitor.MONITOR_NAME: a monitor of the program runner, and the run uid it serves
MEMINFO = "/proc/meminfo"
SOCKET_TABLES = sockets.TABLES
UNLIMITED = 1 << 60  # a cgroup without a limit reports about 2**63


@dataclass(frozen=True)
class Usage:
    """Where a sandbox's memory use is read: ``usage`` (one number, read at every poll) and ``stat`` (the file
    cache to subtract from it, read only near the limit), or ``/proc/meminfo`` alone."""

    limit: int
    usage_path: str = ""
    stat_path: str = ""
    cache_keys: tuple = ()
    # cgroup v1: the kernel memory in the usage (memory.kmem.usage_in_bytes), which v1 does not split: the dentries
    # and inodes the kernel gives back under pressure are in it with socket buffers, pipes and page tables. (v2's
    # memory.stat tells reclaimable slab apart: a cache key.)
    kernel_path: str = ""
    # /proc/meminfo alone (gVisor): socket buffers are its kernel's memory, in no figure of /proc/meminfo (250 filled
    # socket pairs took 53 MB of the host's memory and nothing there). Each socket these files list counts as
    # SOCKET_BYTES: a sandbox has a few dozen; a sample that fills thousands is seen.
    socket_tables: tuple = ()
    # Where the kernel counts the processes its OOM killer killed here (the ``oom_kill`` field): cgroup v1's
    # memory.oom_control, v2's memory.events; gVisor has neither (there the host's OOM killer takes the sandbox).
    events_path: str = ""

    @property
    def longest_sleep(self) -> float:
        """How long the guard may sleep with room to spare: gVisor's memory grows ahead of what it shows."""
        return MAX_INTERVAL_S if self.usage_path else MAX_INTERVAL_S / 5

    @property
    def mark(self) -> int:
        """The use past which the guard acts."""
        fraction = CGROUP_MARGIN_FRACTION if self.usage_path else MEMINFO_MARGIN_FRACTION
        return self.limit - max(MIN_MARGIN_BYTES, self.limit // fraction)

    def pressure(self) -> int:
        """Bytes in use that the kernel cannot reclaim without killing (an upper bound when cheap: the caller asks
        :meth:`exact` before it acts)."""
        if not self.usage_path:
            return self.exact()
        return _read_int(self.usage_path)

    def kernel(self) -> int:
        """The kernel memory in the use, where it shows apart (cgroup v1; 0 elsewhere): see
        :meth:`.memory_guard.Guard._unheld`."""
        return _read_int(self.kernel_path) if self.kernel_path else 0

    def oom_kills(self) -> Optional[int]:
        """How many processes the kernel's OOM killer killed in this sandbox so far (None: it does not say)."""
        if not self.events_path:
            return None
        return _fields(self.events_path, separator=" ").get("oom_kill")

    def exact(self) -> int:
        if not self.usage_path:
            info = _fields(MEMINFO)
            used = (info["MemTotal"] - info.get("MemAvailable", info["MemTotal"])) * 1024
            _LISTED[0] = sum(_rows(path) for path in self.socket_tables)
            return used + SOCKET_BYTES * _LISTED[0]
        usage = _read_int(self.usage_path)
        stat = _fields(self.stat_path, separator=" ")
        return usage - sum(stat.get(key, 0) for key in self.cache_keys)


_OPEN: dict = {}  # path -> descriptor, kept open: under gVisor, pread costs a tenth of open+read (0.3 ms a poll)
_LISTED = [0]  # the sockets /proc/net listed at the last Usage.exact (gVisor)


def sockets_listed() -> int:
    """How many sockets ``/proc/net`` listed at the last :meth:`Usage.exact` (gVisor; 0 elsewhere)."""
    return _LISTED[0]


# A first read's buffer: the files read here are under a page, bar gVisor's /proc/net tables. Under malloc's mmap
# threshold: a 1 MiB buffer cost an mmap, an mremap and a munmap on every read (twice per request in the server, at
# every poll in the memory guard). A file that fills it is read on in 1 MiB turns, as before.
_FIRST_READ_BYTES = 64 << 10


def _read(path: str) -> bytes:
    fd = _OPEN.get(path)
    if fd is None:
        fd = _OPEN[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    data = chunk = os.pread(fd, _FIRST_READ_BYTES, 0)  # a short read of these kernel files is their whole text
    if len(data) == _FIRST_READ_BYTES:  # a large table: the rest in turns, to its end
        while chunk:
            chunk = os.pread(fd, _MIB, len(data))
            data += chunk
    return data


def _read_int(path: str) -> int:
    return int(_read(path).split()[0])


def _rows(path: str) -> int:
    """Lines of a /proc/net table below its header (0 where it does not exist)."""
    try:
        return max(0, _read(path).count(b"\n") - 1)
    except OSError:
        return 0


def _fields(path: str, separator: str = ":") -> dict:
    lines = _read(path).decode().splitlines()
    found = {}
    for line in lines:
        key, _, value = line.partition(separator)
        parts = value.split()
        if parts and parts[0].isdigit():
            found[key.strip()] = int(parts[0])
    return found


def find_usage(root: str = "/sys/fs/cgroup") -> Optional[Usage]:
    """The sandbox's memory use and limit: its memory cgroup (v1, then v2), else ``/proc/meminfo`` (gVisor, whose
    total is the container's limit). None where no limit applies."""
    v1 = os.path.join(root, "memory")
    kmem = os.path.join(v1, "memory.kmem.usage_in_bytes")
    candidates = (
        (os.path.join(v1, "memory.limit_in_bytes"), os.path.join(v1, "memory.usage_in_bytes"),
         os.path.join(v1, "memory.stat"), ("total_active_file", "total_inactive_file"),
         kmem if os.path.exists(kmem) else "", os.path.join(v1, "memory.oom_control")),
        # slab_reclaimable: dentries and inodes, which the kernel frees before it kills (a sample that looked up
        # millions of missing paths filled most of the limit with them; red team)
        (os.path.join(root, "memory.max"), os.path.join(root, "memory.current"), os.path.join(root, "memory.stat"),
         ("active_file", "inactive_file", "slab_reclaimable"), "", os.path.join(root, "memory.events")),
    )
    for limit_path, usage_path, stat_path, keys, kernel_path, events_path in candidates:
        try:
            with open(limit_path, "rb") as f:
                text = f.read().strip()
            limit = UNLIMITED if text == b"max" else int(text)
            _read_int(usage_path)
            _fields(stat_path, separator=" ")
        except (OSError, ValueError):
            continue
        events = events_path if os.path.exists(events_path) else ""
        return Usage(limit, usage_path, stat_path, keys, kernel_path, events_path=events) if limit < UNLIMITED \
            else None
    try:
        return Usage(_fields(MEMINFO)["MemTotal"] * 1024, socket_tables=SOCKET_TABLES)
    except (OSError, KeyError, ValueError):
        return None


class Held(NamedTuple):
    """What the sandbox's processes hold, by their figures (:func:`held`)."""

    totals: dict  # {slot: (bytes it holds, its pids, the pids of its program runner's monitors)}
    everyone: int  # bytes all processes hold (and the slots' files, once Guard._held adds them)
    own: int  # of everyone, resident memory (and the files)
    page_tables: int  # of everyone, page tables
    sockets: int  # of everyone, what sockets hold
    in_flight: int = 0  # gVisor: SOCKET_BYTES for each socket no process holds (Linux: every socket has its uid's)
    server: int = 0  # of everyone, what the server process holds, and its uid's sockets (when in no slot)
    estimated: int = 0  # of sockets, what is a bound charged beyond what they show (.sockets.SocketBytes)


def held(groups: dict, statuses: Iterable[tuple[int, bytes]], socket_bytes: Optional[dict] = None,
         sockets_of: Optional[Callable[[int], tuple]] = None, listed: Iterable[int] = (),
         dying: frozenset = frozenset(), server: Optional[int] = None) -> Held:
    """:class:`Held` from ``(pid, /proc/<pid>/status)`` of the sandbox's processes (``groups`` maps each slot's uids
    to the slot): what each holds of its own (:func:`..processes.tree.resident_kb`) and its page tables; pages a fork
    shares count in each process that maps them: more than the truth, never less. A program runner's monitor
    (root, named MONITOR_NAME and the run uid it serves) counts for that slot: it holds its programs' output.

    Sockets: ``socket_bytes`` ({uid: bytes its sockets queue}, :func:`.sockets.bytes_by_uid`) count for that uid's
    slot; or (gVisor) SOCKET_BYTES for each socket ``sockets_of(pid)`` says a process holds (each counted once; for
    each descriptor of a process with many, :func:`.sockets.held_by`), and each other socket ``listed`` names, less
    those, is in flight (``in_flight``). Not the size of a process's descriptor table: a ``dup2`` to descriptor 511
    made it count for 120 MiB, which excused as much of what no process held and got an innocent killed (red
    team).

    ``dying``: pids the guard just killed, whose memory counts for no slot (it is on its way back), while their
    slot's new processes count as any others.

    ``server``: the server's pid, whose memory (and its uid's sockets) :attr:`Held.server` says."""
    totals: dict = {}
    everyone = own = page_tables = socket_total = counted = server_bytes = 0
    server_uid = None
    seen: set = set()

    def add(group, memory: int, pid: Optional[int] = None, monitor: bool = False) -> None:
        total, pids, monitors = totals.get(group, (0, [], []))
        if pid is not None:
            pids, monitors = pids + [pid] * (not monitor), monitors + [pid] * monitor
        totals[group] = (total + memory, pids, monitors)

    for pid, status in statuses:
        fields = tree.status_fields(status)
        if not fields.get(b"Uid"):
            continue
        resident = tree.resident_kb(fields) * 1024
        tables = tree.status_kb(fields, b"VmPTE") * 1024
        held_sockets = 0
        if sockets_of is not None:
            inodes, descriptors = sockets_of(pid)
            mine = inodes - seen
            seen |= mine
            counted += descriptors
            held_sockets = SOCKET_BYTES * (len(mine) + descriptors)
        everyone += resident + tables + held_sockets
        own += resident
        page_tables += tables
        socket_total += held_sockets
        uid = int(fields[b"Uid"][0])
        name = fields.get(b"Name", [b""])[0]
        monitor = uid == 0 and name.startswith(MONITOR_NAME)  # root's: no sample can name it
        if monitor:
            uid = int(name[len(MONITOR_NAME):]) if name[len(MONITOR_NAME):].isdigit() else 0
        group = groups.get(uid)
        if group is not None and pid not in dying:
            add(group, resident + tables + held_sockets, pid, monitor)
        if pid == server and group is None:
            server_bytes, server_uid = resident + tables + held_sockets, uid
    for uid, queued in (socket_bytes or {}).items():
        everyone += queued
        socket_total += queued
        if groups.get(uid) is not None:
            add(groups[uid], queued)
        elif uid == server_uid:
            server_bytes += queued
    in_flight = SOCKET_BYTES * max(0, len(set(listed) - seen) - counted)  # without sockets_of: each listed one
    return Held(totals, everyone, own, page_tables, socket_total, in_flight, server_bytes,
                getattr(socket_bytes, "estimated", 0))

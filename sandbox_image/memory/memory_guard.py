"""The memory guard: near the sandbox's memory limit, the sample whose processes hold the most *together* dies.

The kernel's OOM killer ranks processes one by one. A sample that spreads its memory over its own forks (36 of 24
MiB, within its process limit) or puts it where no process's resident set shows it (filled socket buffers, a
program's output the runner holds) is smaller, process by process, than an innocent concurrent sample of 60 MiB:
at the container's limit the innocent was killed and the hog scored (red team, runc). gVisor has no OOM killer
inside the sandbox: the host's kills its kernel, and with it every sample of the container.

So the supervisor (root, with KILL) watches how much of the limit is in use that the kernel cannot give back
(:class:`.memory_use.Usage`): the memory cgroup's usage less its file cache (v1 or v2; v2 less reclaimable slab too);
under gVisor, which has no cgroup files, ``/proc/meminfo`` (whose total is the container's limit) plus SOCKET_BYTES
for each socket of the sandbox (its kernel's socket buffers are in no figure there). Past the mark
(:attr:`.memory_use.Usage.mark`: an eighth of the limit below it, a quarter under gVisor) it adds up, per slot, what
its processes hold (:func:`.memory_use.held`): those of the slot's uid and of the uid of the programs its reward code
runs, and the runner's monitor that serves them (root, known by its name, which no sample can set); resident
anonymous and shared memory, page tables, what their sockets hold (:mod:`.sockets`: Linux says what each uid's
sockets queue; under gVisor SOCKET_BYTES for each socket a process holds), and the files in the slot's tmpfs. The
slot that holds the most is stopped at once and killed whole (:func:`kill_group`: kill(-1) as its uid, as a slot is
cleaned up before its next process takes it; its monitor directly). The server sees the slot's process die and blames
the unit it was scoring (``crash``); later samples run in fresh processes, and the sandbox's log says why.

Memory that no process holds is no sample's to pay for (:meth:`Guard._unheld`): sockets in flight under gVisor (sent
over a Unix socket, then closed; what gVisor keeps in Unix sockets sent over themselves), and under cgroup v1 kernel
memory grown since the sandbox was calm past what processes' page tables and sockets account for (the dentries of
missing paths a sample looked up by the million, which the kernel frees only at the limit; pipes). A sample is
killed only when what processes hold takes the use past the mark on its own. What no process held in calm times
already (what finished samples left) only moves the mark toward the limit, up to half the margin (red teams: a
sample that left 30 MiB of dentries got one of two innocents killed in every later batch, when it only lowered the
mark); what appears while samples run is no room for anyone. Past half the margin, or when what appeared since calm
times takes the use past the mark on its own (MIN_MARGIN_BYTES or more), the supervisor ends instead: the server
reports NOT_SERVING, and the host starts the sandbox afresh, which frees it. What the server process holds past its
calm level (the call's request, its samples' answers and output, until it replies: :meth:`Guard._grown`) moves the
mark as well, within the same half margin; past it, it weighs as what no process holds that appeared since. The
same happens once slot tmpfs that gVisor could not free (:func:`..confine.private_tmp.renew`) hold a quarter of the
limit.

It polls: one read of one file (gVisor: a few, kept open) while there is room, more often the closer the mark is
(the time memory takes to grow to it at GROWTH_BYTES_PER_S, within MIN_INTERVAL_S and MAX_INTERVAL_S, a fifth of
that under gVisor), and reads ``/proc`` of every process only past the mark (every MAX_INTERVAL_S while what no
process holds keeps the use past it), and every CALIBRATE_S. What it does not bound: memory that grows faster than
that (under runc the kernel's OOM killer is still behind it); under gVisor, what sockets hold is counted at
SOCKET_BYTES each, not at what they queue; under cgroup v2, kernel memory other than sockets and reclaimable slab
(pipes) is weighed with what processes usually count twice, as the rest of the use.
"""

from __future__ import annotations

import enum
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from ..processes import tree
from . import sockets
from .memory_use import MAX_INTERVAL_S, MIN_MARGIN_BYTES, Held, Usage, held, sockets_listed

_MIB = 1 << 20
GROWTH_BYTES_PER_S = 8 << 30  # how fast the samples' memory may grow, for how long the guard may sleep
MIN_INTERVAL_S = 0.002
IDLE_INTERVAL_S = 0.25  # the longest the guard sleeps while the server has no call in flight (see Guard.quiet)
SETTLE_S = 0.5  # after a kill, see Guard.reaped
# Once replaced slot tmpfs hold limit / UNHELD_FRACTION (gVisor: private_tmp.leaked_bytes, read every RENEWED_S),
# the sandbox restarts; so it does, past the mark, once what no process nor file holds is half the margin or more
# (Guard.check; counted against the figures' excess over the use in calm times, read every CALIBRATE_S).
UNHELD_FRACTION = 4
CALIBRATE_S = 5.0
CALIBRATIONS = 6
RENEWED_S = 1.0
RESTART = -1  # what Guard.check returns when the sandbox must start afresh
# A real uid no sample process has, for the child that kills a slot's processes: a fresh slot process cleaning up
# after its uid has real uid uid | tree.REAPER_UID_BIT, and the two must not be able to signal each other.
GUARD_UID_BIT = 1 << 30


def kill_group(uids: tuple, atomic: bool, sig: int = signal.SIGKILL) -> int:
    """Forks a child that kills every process of ``uids`` (see :func:`tree.kill_uid`), or sends them all ``sig``
    (kill(-1) as each uid: Linux lets no fork pass it; gVisor, a few times over). Returns its pid."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            for uid in uids:
                os.setresuid(0, 0, 0)
                os.setresuid(uid | GUARD_UID_BIT, uid, 0)
                if sig == signal.SIGKILL:
                    tree.kill_uid(uid, atomic=atomic)
                    continue
                for _ in range(1 if atomic else tree.STABLE_SCANS):
                    try:
                        os.kill(-1, sig)
                    except ProcessLookupError:
                        pass
            code = 0
        finally:
            os._exit(code)
    return pid


def stop(pid: int, sig: int = signal.SIGSTOP) -> None:
    try:
        os.kill(pid, sig)
    except OSError:
        pass


class Action(enum.Enum):
    """What the guard does about one reading past the mark (:func:`decide`)."""

    NONE = "none"  # nothing: no sample holds anything
    WAIT = "wait"  # what samples hold is under the mark, once it moved by what is no sample's: read again later
    KILL = "kill"  # the slot that holds the most goes
    RESTART = "restart"  # killing a sample would free none of what fills the sandbox: it starts afresh


@dataclass(frozen=True)
class Reading:
    """One reading past the mark, in bytes (what :meth:`Guard.check` read of the usage and of ``/proc``)."""

    use: int  # in use that the kernel cannot give back
    unheld: int  # of it, held by no process nor any slot's files
    server_grown: int  # what the server holds past its calm level (Guard._grown)
    held: dict  # slot uid -> (bytes its processes and files hold together, whether any process of it runs)
    settling: bool  # within SETTLE_S of the end of a kill: the killed processes' memory may still be coming back
    just_killed: Optional[int] = None  # the slot killed last, while its processes are dying


@dataclass(frozen=True)
class Calm:
    """What the guard keeps between readings: the sandbox's limit, its mark, and what no process held at the last
    calm reading (Guard._calibrate)."""

    limit: int
    mark: int
    unheld: int


@dataclass(frozen=True)
class Decision:
    action: Action
    slot: Optional[int] = None  # KILL: the slot uid
    moved: int = 0  # WAIT: how far the mark moves, until the next scan
    why: str = ""  # RESTART: the figures, for the log


def decide(reading: Reading, calm: Calm) -> Decision:
    """The guard's choice past the mark: kill the slot that holds the most, restart the sandbox, or wait (the mark
    moved by what is no sample's). Plain arithmetic over the two records; the guard reads, then acts on this."""
    most_unheld = (calm.limit - calm.mark) // 2
    # What no process held in calm times already (what finished samples left: dentries, sockets in flight) moves
    # the mark; what appeared since may be a running sample's doing, which it must not buy room with: empty
    # sockets (kernel memory no queue shows) moved the mark 41 MiB, 32 forks filled it at once, and the
    # kernel's OOM killer took an innocent before the guard acted (red team).
    calm_part = min(reading.unheld, calm.unheld, most_unheld)
    # What the server holds past its calm level is no sample's either: the call's request (about six times the
    # size of its completions) and its samples' answers and output, until it replies (counted as processes'
    # memory, thousands of chatty samples grew it 80 MiB and an innocent near the mark was killed for it).
    # Within the same half margin it moves the mark: weighed from its first MiB as memory that appeared since
    # calm times, a hog whose own completion was padded made every part of every retry restart, and every
    # innocent ended unavailable. Past that half margin it is weighed so, as ``excess`` (a batch of padded
    # completions, held several times over, got a 400 MiB innocent killed). (Red teams, runc.)
    grown = reading.server_grown
    moved = min(grown, most_unheld - calm_part)  # how far it moves the mark: half the margin at most
    left = calm_part + moved
    excess = grown - moved  # what the server grew by past the moved mark
    since = reading.unheld - calm_part + excess  # no sample's, appeared since calm times, not in the moved mark
    use = reading.use
    why = f"{use / _MIB:.0f} of the sandbox's {calm.limit / _MIB:.0f} MiB in use, {reading.unheld / _MIB:.0f} " \
          f"MiB of it held by no process nor any sample's files, {grown / _MIB:.0f} MiB more by the server than " \
          f"in calm times"
    if not reading.settling and reading.unheld >= most_unheld:
        # Killing a sample would free none of it (gVisor keeps Unix sockets sent over themselves and what rides
        # in them; dentries), would take an innocent (red teams), and it leaves too little of the margin.
        return Decision(Action.RESTART, why=why)
    if use - left < calm.mark:
        # What samples hold is under the mark: what no process held in calm times, and what the server holds past
        # its calm level, are no sample's to pay for.
        return Decision(Action.WAIT, moved=left)
    if not reading.settling and (since >= max(MIN_MARGIN_BYTES, use - left - calm.mark)
                                 or 0 < excess >= use - left - calm.mark):
        # What no process holds (or the server past the moved mark) takes the use past the mark, and appeared
        # since calm times: killing a sample would free none of it and take an innocent. Less than
        # MIN_MARGIN_BYTES of the kernel's own is memory coming and going with the samples' work (pipes,
        # processes; a program's output through the runner took 5 MiB). The server's figure is exact: any of its
        # excess that does so restarts (held to MIN_MARGIN_BYTES too, 64 KiB completions grew the server 90 MiB
        # and a 787 MiB innocent was killed in 6 of 10 batches: red team).
        return Decision(Action.RESTART, why=why)
    # The slot just killed that runs no process yet: what is counted for it are the killed sample's files.
    candidates = {slot: total for slot, (total, running) in reading.held.items()
                  if not (slot == reading.just_killed and not running)}
    if not candidates:
        return Decision(Action.NONE)
    return Decision(Action.KILL, slot=max(candidates, key=lambda slot: candidates[slot]))


class Guard:
    """See the module docstring. ``slots``: (slot uid, its directory, run uid or None, its directory) of each slot
    of the sandbox (a directory "" when it is not a tmpfs of its own). The other arguments are where it reads and
    how it stops and kills (tests pass their own); ``renewed``: :func:`..confine.private_tmp.leaked_bytes` under
    gVisor."""

    def __init__(self, slots: Iterable[tuple], usage: Usage, atomic_kill: bool,
                 statuses: Callable[[], Iterable] = tree.statuses, stop: Callable[..., None] = stop,
                 kill: Callable[..., int] = kill_group, clock: Callable[[], float] = time.monotonic,
                 directory_bytes: Callable[[str], int] = tree.unnamed_bytes,
                 renewed: Optional[Callable[[], int]] = None,
                 wait: Callable[[int], object] = lambda pid: os.waitpid(pid, 0),
                 socket_bytes: Callable[[], Optional[dict]] = sockets.bytes_by_uid,
                 sockets_of: Callable[[int], tuple] = sockets.held_by, listed: Callable[[], set] = sockets.listed,
                 server: Optional[int] = None):
        self.groups = {}
        self.members: dict = {}
        self.directories: dict = {}  # slot -> the tmpfs directories of its uids
        for uid, directory, run_uid, run_directory in slots:
            self.members[uid] = (uid,) if run_uid is None else (uid, run_uid)
            self.directories[uid] = tuple(d for d in (directory, run_directory) if d)
            for member in self.members[uid]:
                self.groups[member] = uid
        self.directory_bytes = directory_bytes
        self.server = server  # the server's pid: see _grown
        self.renewed = renewed  # gVisor (chroot): bytes held in replaced slot tmpfs, read every RENEWED_S
        self.next_renewed = 0.0
        self.usage = usage
        self.mark = usage.mark
        self.atomic_kill = atomic_kill
        self.statuses, self.stop, self.kill, self.clock, self.wait = statuses, stop, kill, clock, wait
        # What sockets hold (see held): Linux says it by uid; under gVisor (its /proc/net counted in the use), which
        # sockets processes hold open, the rest being in flight. Neither: what sockets hold is no process's.
        self.socket_bytes = socket_bytes if usage.usage_path and socket_bytes() is not None else None
        self.sockets_of: Optional[Callable[[int], tuple]] = sockets_of if usage.socket_tables else None
        self.listed: Optional[Callable[[], set]] = listed if usage.socket_tables else None
        self.free_pass = 0  # what no process holds, as last read past the mark: see check
        self.calm_unheld = 0  # what no process held at the last calm reading: see _calibrate
        self.next_scan = 0.0
        self.scan_s = 0.0  # how long reading what every process holds took, last time
        self.killing: dict = {}  # pid of a killing child -> its slot
        self.next_check = 0.0
        self.idle = False  # the server has no call in flight (see quiet)
        # After a kill: until settle_until, only use above floor kills again (the killed processes' memory may take
        # a while to come back: gVisor gives it back over hundreds of milliseconds, and killed an innocent next).
        self.settle_until = 0.0
        self.floor = 0
        self.last_killed: Optional[int] = None
        self.offset = 0  # see _calibrate
        self.readings: list = []
        self.server_readings: list = []  # what the server held in calm times: see _grown
        self.kernel_floor: Optional[int] = None  # see _unheld
        self.next_calibration = 0.0
        self.dying: frozenset = frozenset()  # the processes of the slot last killed (see check)

    def quiet(self, idle: bool) -> None:
        """The server says it has had no call in flight for a while (``idle``), or has one again. Between calls
        nothing of a sample runs: a slot process waits for its next request, and what a finished sample left is
        killed by its slot's next process at once (a worker's own threads are the exception its user vouched
        for). So the guard reads no more often than memory could grow to the mark at GROWTH_BYTES_PER_S (without
        the shorter sleep gVisor's lagging figures get while samples run); the next call has it read at once."""
        self.idle = idle
        if not idle:
            self.next_check = min(self.next_check, self.clock())

    def timeout(self) -> float:
        """Seconds until the next check is due (0: now)."""
        return max(0.0, self.next_check - self.clock())

    def check(self) -> Optional[int]:
        """Reads the usage; past the mark, kills the slot that holds the most, when what processes hold takes the use
        past it on its own (unless one is being killed, or the last one's memory may still be coming back). Returns
        the slot uid it started killing, RESTART when what no process holds is half the margin or more, or appeared
        since calm times and takes the use past the mark on its own (the sandbox must start afresh), or None. It
        reads here and acts on :func:`decide`'s choice."""
        now = self.clock()
        try:
            pressure = self.usage.pressure()
            if pressure >= self.mark:
                pressure = self.usage.exact()
        except (OSError, ValueError, KeyError):
            self.next_check = now + MAX_INTERVAL_S
            return None
        if pressure < self.mark:
            self.free_pass = 0
        room = self.mark + self.free_pass - pressure
        self._check_again(now, room)
        if self.renewed is not None and now >= self.next_renewed:
            self.next_renewed = now + RENEWED_S
            try:
                leaked = self.renewed()
            except (OSError, ValueError):
                leaked = 0
            if leaked >= self.usage.limit // UNHELD_FRACTION:
                return self._restart(f"replaced slot tmpfs hold {leaked / _MIB:.0f} MiB that Unix sockets sent over "
                                     f"themselves keep (gVisor never frees those)", self._held().totals)
        if pressure < 2 * self.mark - self.usage.limit and now >= self.next_calibration:
            self._calibrate(now)  # in calm times only: under gVisor it takes 20 ms, which a hog could use to grow
        if pressure < self.mark or (room > 0 and now < self.next_scan) or self.killing \
                or (now < self.settle_until and pressure < self.floor):
            return None
        most_unheld = (self.usage.limit - self.mark) // 2
        # While memory comes back after a kill, what the killed processes still show counts for no slot; their
        # slot's next process, which may already run another sample, counts as any other. (Skipping the whole slot
        # while it held less than the killed ones had, which forks sharing pages inflate, let a sample there fill
        # 680 MiB past the mark and got a 390 MiB innocent killed in 13 of 33 runs: red team.)
        dying = self.dying if now < self.settle_until else frozenset()
        found = self._held(listed=range(sockets_listed()), dying=dying) if self.sockets_of is not None else None
        if found is not None and \
                pressure - min(self._unheld(pressure, found) + self._grown(found), most_unheld) >= self.mark:
            # Even were every socket in flight, what processes hold of their own takes the use past the mark: the
            # one holding the most goes. Under gVisor, reading which sockets they hold costs 15 ms or more (a
            # readlink each): 12 forks of 80 MiB each outran a guard that read them first, and the host killed the
            # sandbox.
            unheld = 0
        else:
            # The use is read just before and just after what processes hold: while a hog fills socket buffers,
            # kernel memory grew 35 MiB between the guard's sock_diag read and its kernel memory read, was taken for
            # memory no process holds, and the sandbox restarted instead of the hog dying (fresh-clone CI run).
            # Of the two readings the one that finds less held by no process counts, with its own use: memory that
            # came or went during the scan is never taken for it, and what a sample fills and drains (pipes) is never
            # seen full in one reading and missing from what no process holds in the other (an innocent, the
            # largest holder, was killed so in a unit test's staging).
            started = time.monotonic()
            try:
                before = self.usage.exact(), self.usage.kernel()
                found = self._held(dying=dying)
                after = self.usage.exact(), self.usage.kernel()
            except (OSError, ValueError, KeyError):
                self.next_check = now + MAX_INTERVAL_S
                return None
            self.scan_s = time.monotonic() - started
            unheld, pressure = min((self._unheld(use, found, kernel), use) for use, kernel in (before, after))
        totals = found.totals
        decision = decide(Reading(use=pressure, unheld=unheld, server_grown=self._grown(found),
                                  held={slot: (total, bool(pids or monitors))
                                        for slot, (total, pids, monitors) in totals.items()},
                                  settling=now < self.settle_until,
                                  just_killed=self.last_killed if dying else None),
                          Calm(limit=self.usage.limit, mark=self.mark, unheld=self.calm_unheld))
        if decision.action is Action.RESTART:
            return self._restart(decision.why, totals)
        if decision.action is Action.WAIT:
            # They move the mark while they last (read again every MAX_INTERVAL_S or more: they may be freed).
            self.free_pass, self.next_scan = decision.moved, now + max(MAX_INTERVAL_S, 5 * self.scan_s)
            room = self.mark + decision.moved - pressure
            self._check_again(now, room)
            return None
        self.free_pass = 0
        slot = decision.slot
        if decision.action is Action.NONE or slot is None:
            return None
        most, pids, monitors = totals[slot]
        for pid in pids:  # at once, before the fork of the killer: its memory stops growing now
            self.stop(pid)
        for pid in monitors:  # root's, which the killer cannot reach: the runner starts the slot's next one
            self.stop(pid, signal.SIGKILL)
        self.last_killed, self.dying = slot, frozenset(pids) | frozenset(monitors)
        try:
            self.killing[self.kill(self.members[slot], self.atomic_kill)] = slot
        except OSError as e:  # no fork now (its own memory, the container's pids): stopped, it is killed next check
            self._log(f"could not fork to kill the processes of slot uid {slot}: {e}")
            return None
        self._log(f"{pressure / _MIB:.0f} of the sandbox's {self.usage.limit / _MIB:.0f} MiB in use; killed the "
                  f"processes of slot uid {slot}, which held {most / _MIB:.0f} MiB together, the most of any sample")
        return slot

    def _check_again(self, now: float, room: int) -> None:
        """The next check: as long as memory takes to fill ``room`` bytes at GROWTH_BYTES_PER_S, within
        MIN_INTERVAL_S and the usage's longest sleep (IDLE_INTERVAL_S between calls: see quiet)."""
        longest = IDLE_INTERVAL_S if self.idle and not self.killing else self.usage.longest_sleep
        self.next_check = now + min(longest, max(MIN_INTERVAL_S, room / GROWTH_BYTES_PER_S))

    def _restart(self, why: str, totals: dict) -> int:
        """Stops every sample's processes and the monitors serving them (what kept running grew, unguarded, until
        the host's OOM killer took the sandbox; red team), then returns RESTART: the supervisor ends, the server
        answers the requests in flight UNAVAILABLE (the host scores them again elsewhere: killed, they would have
        ended ``crash``), reports NOT_SERVING, and the host starts the sandbox afresh."""
        self._log(f"{why}: the sandbox stops, to be started afresh")
        for _, pids, monitors in totals.values():
            for pid in pids + monitors:
                self.stop(pid)
        try:
            self.wait(self.kill(tuple(uid for members in self.members.values() for uid in members), self.atomic_kill,
                                signal.SIGSTOP))
        except OSError:
            pass
        return RESTART

    def _calibrate(self, now: float) -> None:
        """How much more than the use its figures add up to (pages shared by forks count in each process), so that
        what no process holds is not hidden behind it: the least excess of the last CALIBRATIONS readings, taken
        while the use is under the mark (a sample that inflates its own figures for one reading cannot make the
        guard take what it holds for memory no one holds: red team). Only the processes' own memory is weighed so
        (and the use less kernel memory, where that shows apart: cgroup v1; less the sockets in flight, under
        gVisor): what sockets hold is read as it is, and under cgroup v1 the least kernel memory no figure accounts
        for is kept instead (``kernel_floor``, see :meth:`_unheld`)."""
        self.next_calibration = now + CALIBRATE_S
        try:
            found = self._held()
            exact = self.usage.exact()
            # What sockets show, not the bounds charged for blame beyond it (sockets.SocketBytes): weighed against
            # a bound that later goes, calm times would make every later hog look like memory no one holds.
            if self.usage.kernel_path:
                kernel = self.usage.kernel()
                excess = exact - kernel - found.own
                other = kernel - found.page_tables - (found.sockets - found.estimated)
                self.kernel_floor = other if self.kernel_floor is None else min(self.kernel_floor, other)
            else:
                excess = exact - found.in_flight - (found.everyone - found.estimated)
        except (OSError, ValueError, KeyError):
            return
        self.readings = (self.readings + [excess])[-CALIBRATIONS:]
        self.offset = min(0, max(self.readings))
        self.calm_unheld = self._unheld(exact, found)
        self.server_readings = (self.server_readings + [found.server])[-CALIBRATIONS:]

    def _grown(self, found: Held) -> int:
        """What the server process holds past the least it held in the last CALIBRATIONS calm readings: no sample's
        memory, and killing one frees none of it. Of the sandbox's own processes only the server's memory grows with
        what samples do (their answers and output, until it replies); what it keeps for good after a busy call (its
        heap) becomes its calm level within CALIBRATIONS readings. Not the supervisor's templates' or runner's
        figures: a slot process just forked is root, named as its template, and counts its template's pages."""
        return max(0, found.server - min(self.server_readings)) if self.server_readings else 0

    def _unheld(self, use: int, found: Held, kernel: Optional[int] = None) -> int:
        """Bytes of ``use`` that no process nor any slot's files hold: what the processes' figures do not add up to,
        less what they usually count twice (:meth:`_calibrate`), and sockets in flight (gVisor). Under cgroup v1,
        kernel memory apart: the processes' own memory is weighed against the rest of the use, and the kernel memory
        that neither page tables nor sockets account for, since the least of it read in calm times, is no process's
        (dentries of missing paths looked up, pipes): the kernel frees the dentries only at the limit. Calibrated in
        as the figures' usual excess, a sample's dentries got innocents killed near the mark (red team, runc)."""
        if not self.usage.kernel_path:
            return max(0, use - found.in_flight - found.everyone - self.offset) + found.in_flight
        kernel = self.usage.kernel() if kernel is None else kernel
        other = kernel - found.page_tables - found.sockets
        floor = other if self.kernel_floor is None else self.kernel_floor
        return max(0, use - kernel - found.own - self.offset) + max(0, other - floor)

    def _held(self, listed: Optional[Iterable[int]] = None, dying: frozenset = frozenset()) -> Held:
        """:func:`held` of the sandbox's processes and sockets, each slot's files counted for it (a sample's files are
        its memory too) and in the totals. With ``listed`` (gVisor), no process's sockets are read: each of those
        may be in flight. ``dying``: processes just killed, counted for no slot."""
        if listed is not None:
            found = held(self.groups, self.statuses(), listed=listed, dying=dying, server=self.server)
        else:
            found = held(self.groups, self.statuses(), self.socket_bytes() if self.socket_bytes is not None else None,
                         self.sockets_of, self.listed() if self.listed is not None else (), dying, self.server)
        totals, everyone, own = found.totals, found.everyone, found.own
        for slot, directories in self.directories.items():
            files = sum(self._directory_bytes(d) for d in directories)
            if files:
                total, pids, monitors = totals.get(slot, (0, [], []))
                totals[slot] = (total + files, pids, monitors)
                everyone += files
                own += files
        return found._replace(everyone=everyone, own=own)

    def _directory_bytes(self, directory: str) -> int:
        try:
            return self.directory_bytes(directory)
        except OSError:
            return 0

    @staticmethod
    def _log(message: str) -> None:
        sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} sandbox WARNING memory guard: {message}\n")
        sys.stderr.flush()

    def reaped(self, pid: int) -> None:
        """A child of the supervisor exited: if it was killing a slot, checks resume at once, and for SETTLE_S only
        use above what is in use now (plus half the margin) kills again."""
        if self.killing.pop(pid, None) is None:
            return
        self.next_check = 0.0
        self.settle_until = self.clock() + SETTLE_S
        try:
            self.floor = self.usage.exact() + (self.usage.limit - self.mark) // 2
        except (OSError, ValueError, KeyError):
            self.floor = self.usage.limit

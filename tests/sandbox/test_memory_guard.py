"""The memory guard's reading and deciding (``rewardbox.sandbox.memory_guard``), on files laid out as the kernel and
gVisor lay them out. What it does to real samples near a real container's limit, under runc and gVisor:
tests/docker/test_reuse.py (``..._dies_near_the_limit_not_an_innocent``)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field

import pytest

from rewardbox.sandbox import memory_guard
from rewardbox.sandbox.memory_guard import Guard, Usage, find_usage, held

MIB = 1 << 20
SLOT, RUN, OTHER_SLOT, OTHER_RUN = 100001, 200001, 100002, 200002


def status(uid: int, rss_anon_kb: int = 0, shmem_kb: int = 0, pte_kb: int = 0, fds: int = 64,
           gvisor: bool = False, ppid: int = 1) -> bytes:
    """A /proc/<pid>/status as Linux writes it (gVisor: its resident set and descriptors only)."""
    if gvisor:
        return f"Name:\tpython3\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nFDSize:\t{fds}\nVmRSS:\t{rss_anon_kb} kB\n".encode()
    return (f"Name:\tpython3\nState:\tS (sleeping)\nPPid:\t{ppid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\nFDSize:\t{fds}\n"
            f"VmRSS:\t{rss_anon_kb + shmem_kb + 9000} kB\nRssAnon:\t{rss_anon_kb} kB\nRssFile:\t9000 kB\n"
            f"RssShmem:\t{shmem_kb} kB\nVmPTE:\t{pte_kb} kB\n").encode()


GROUPS = {SLOT: SLOT, RUN: SLOT, OTHER_SLOT: OTHER_SLOT, OTHER_RUN: OTHER_SLOT}
EVERY_UID = (SLOT, RUN, OTHER_SLOT, OTHER_RUN)  # a restart stops every sample's processes first


FDS = 64 * memory_guard.SOCKET_BYTES  # what a process's smallest descriptor table may hold in socket buffers


def test_a_sample_split_over_many_small_processes_holds_more_than_one_larger_process():
    statuses = [(10 + k, status(SLOT, rss_anon_kb=24 << 10)) for k in range(36)]
    statuses.append((99, status(OTHER_SLOT, rss_anon_kb=60 << 10)))
    totals, everyone, *_ = held(GROUPS, statuses)
    assert totals[SLOT] == (36 * ((24 << 20) + FDS), list(range(10, 46)), [])
    assert totals[OTHER_SLOT] == ((60 << 20) + FDS, [99], [])
    assert everyone == ((36 * 24 + 60) << 20) + 37 * FDS


def test_what_a_slots_programs_hold_counts_for_the_slot_and_other_uids_for_nobody():
    statuses = [(1, status(SLOT, rss_anon_kb=100 << 10)), (2, status(RUN, rss_anon_kb=100 << 10, pte_kb=1024)),
                (3, status(0, rss_anon_kb=900 << 10)), (4, status(65534, rss_anon_kb=900 << 10)),
                (5, b"Name:\tbroken\n")]
    totals, everyone, *_ = held(GROUPS, statuses)
    assert totals == {SLOT: ((200 << 20) + (1 << 20) + 2 * FDS, [1, 2], [])}
    assert everyone == (2000 << 20) + (1 << 20) + 4 * FDS  # what trusted processes hold is held too


def test_a_program_runners_monitor_counts_for_the_slot_whose_programs_it_serves_by_its_name():
    monitor = status(0, rss_anon_kb=700 << 10).replace(b"Name:\tpython3", b"Name:\trbxm-200002")
    impostor = status(SLOT, rss_anon_kb=10 << 10).replace(b"Name:\tpython3", b"Name:\trbxm-200002")
    totals = held(GROUPS, [(1, monitor), (2, impostor)]).totals
    assert totals == {OTHER_SLOT: ((700 << 20) + FDS, [], [1]), SLOT: ((10 << 20) + FDS, [2], [])}


def test_shared_memory_and_every_descriptor_count_and_file_pages_do_not():
    one = held(GROUPS, [(1, status(SLOT, rss_anon_kb=1024, shmem_kb=2048, fds=512))])[0][SLOT][0]
    assert one == (3 << 20) + 512 * memory_guard.SOCKET_BYTES


def test_gvisor_status_files_count_their_resident_set_and_descriptors():
    assert held(GROUPS, [(1, status(SLOT, rss_anon_kb=1024, fds=100, gvisor=True))])[0][SLOT][0] == \
        (1 << 20) + 100 * memory_guard.SOCKET_BYTES


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v1_usage_less_the_file_cache_and_its_kernel_memory_apart(tmp_path):
    _write(tmp_path / "memory/memory.limit_in_bytes", f"{1 << 30}\n")
    _write(tmp_path / "memory/memory.usage_in_bytes", f"{900 << 20}\n")
    _write(tmp_path / "memory/memory.stat", f"cache 1\ntotal_active_file {100 << 20}\ntotal_inactive_file "
                                            f"{50 << 20}\ntotal_shmem {300 << 20}\n")
    usage = find_usage(str(tmp_path))
    assert usage.limit == 1 << 30 and usage.mark == (1 << 30) - (128 << 20)
    assert usage.pressure() == 900 << 20 and usage.exact() == 750 << 20
    assert usage.kernel() == 0  # a kernel without kernel memory accounting
    _write(tmp_path / "memory/memory.kmem.usage_in_bytes", f"{200 << 20}\n")
    assert find_usage(str(tmp_path)).kernel() == 200 << 20


def test_cgroup_v2_usage_less_the_file_cache_and_the_slab_the_kernel_can_reclaim(tmp_path):
    _write(tmp_path / "memory.max", f"{2 << 30}\n")
    _write(tmp_path / "memory.current", f"{1 << 30}\n")
    _write(tmp_path / "memory.stat", f"anon 5\nactive_file {1 << 20}\ninactive_file {2 << 20}\n"
                                     f"slab_reclaimable {500 << 20}\nslab_unreclaimable {7 << 20}\n")
    usage = find_usage(str(tmp_path))
    assert usage.limit == 2 << 30 and usage.exact() == (1 << 30) - (503 << 20) and usage.kernel() == 0


@pytest.mark.parametrize("limit", ["max\n", f"{1 << 62}\n"])
def test_no_guard_where_the_cgroup_sets_no_limit(tmp_path, limit):
    _write(tmp_path / "memory.max", limit)
    _write(tmp_path / "memory.current", "1\n")
    _write(tmp_path / "memory.stat", "anon 1\n")
    assert find_usage(str(tmp_path)) is None


def test_without_cgroup_files_meminfo_and_the_sockets_count(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  1048576 kB\nMemFree:  500000 kB\nMemAvailable:  524288 kB\n")
    unix = tmp_path / "unix"
    unix.write_text("Num RefCount Protocol Flags Type St Inode Path\n" + "0000: 00000002 0 0 1 03 1\n" * 10)
    usage = Usage(1 << 30, socket_tables=(str(unix), str(tmp_path / "absent")))
    monkeypatch.setattr(memory_guard, "MEMINFO", str(meminfo))
    assert usage.pressure() == usage.exact() == (512 << 20) + 10 * memory_guard.SOCKET_BYTES
    assert usage.mark == (1 << 30) - (1 << 30) // 4
    assert usage.longest_sleep < memory_guard.MAX_INTERVAL_S  # gVisor's memory grows ahead of what it shows


@dataclass
class FakeUsage:
    limit: int = 1 << 30
    now: int = 0
    kernel_now: int = 0  # of ``now``
    kernel_path: str = ""  # "v1": kernel memory shows apart
    reads: list = field(default_factory=list)
    longest_sleep: float = memory_guard.MAX_INTERVAL_S

    @property
    def mark(self) -> int:
        return self.limit - (128 << 20)

    def pressure(self) -> int:
        self.reads.append("pressure")
        return self.now + (64 << 20)  # the cheap figure: more than the exact one (file cache)

    def exact(self) -> int:
        self.reads.append("exact")
        return self.now

    def kernel(self) -> int:
        return self.kernel_now


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


TEMPLATE = 4000  # the pid of the template whose children the slot processes are


def _guard(usage, statuses, files=None, monitors_killed=None, frozen=None):
    stopped, killed, clock = [], [], Clock()
    frozen = frozen if frozen is not None else []
    monitors_killed = monitors_killed if monitors_killed is not None else []

    def stop(pid, sig=signal.SIGSTOP):
        (stopped if sig == signal.SIGSTOP else monitors_killed).append(pid)
    files = files if files is not None else {}

    def kill(uids, atomic, sig=signal.SIGKILL):
        (killed if sig == signal.SIGKILL else frozen).append((uids, atomic))
        return 7000 + len(killed)

    guard = Guard([(SLOT, "/tmp/slot-a", RUN, "/tmp/run-a"), (OTHER_SLOT, "/tmp/slot-b", OTHER_RUN, "/tmp/run-b")],
                  usage, atomic_kill=True, statuses=lambda: statuses, stop=stop, kill=kill, clock=clock,
                  directory_bytes=lambda d: files.get(d, 0), wait=lambda pid: None, templates=lambda: (TEMPLATE,))
    return guard, stopped, killed, clock


def test_below_the_mark_it_reads_one_figure_and_kills_nobody_and_sleeps_longer_the_more_room():
    usage = FakeUsage(now=100 << 20)
    guard, stopped, killed, clock = _guard(usage, [])
    assert guard.check() is None and usage.reads == ["pressure", "exact"] and not killed  # "exact": calibrating
    clock.t += 1.0
    assert guard.check() is None and usage.reads[2:] == ["pressure"]  # calibrated every CALIBRATE_S only
    assert guard.timeout() == pytest.approx(memory_guard.MAX_INTERVAL_S)
    usage.now = usage.mark - (50 << 20)  # the cheap figure passes the mark: the exact one says there is room
    assert guard.check() is None and usage.reads[-2:] == ["pressure", "exact"]
    assert memory_guard.MIN_INTERVAL_S <= guard.timeout() < memory_guard.MAX_INTERVAL_S


def test_past_the_mark_the_slot_holding_most_together_is_stopped_then_killed_with_its_programs():
    statuses = [(10 + k, status(SLOT, rss_anon_kb=24 << 10)) for k in range(36)]
    statuses += [(90, status(OTHER_SLOT, rss_anon_kb=60 << 10)), (91, status(OTHER_RUN, rss_anon_kb=100 << 10))]
    usage = FakeUsage(now=(1 << 30) - (100 << 20))
    guard, stopped, killed, clock = _guard(usage, statuses)
    assert guard.check() == SLOT
    assert stopped == list(range(10, 46)) and killed == [((SLOT, RUN), True)]
    assert guard.check() is None and len(killed) == 1  # while its killer runs, nobody else


def test_after_a_kill_memory_coming_back_slowly_kills_nobody_else_but_new_growth_does():
    statuses = [(1, status(SLOT, rss_anon_kb=900 << 10)), (2, status(OTHER_SLOT, rss_anon_kb=60 << 10))]
    usage = FakeUsage(now=(1 << 30) - (100 << 20))
    guard, stopped, killed, clock = _guard(usage, statuses)
    assert guard.check() == SLOT
    guard.reaped(4242)  # another child of the supervisor: nothing changes
    assert guard.check() is None
    guard.reaped(7001)  # the killer ended; the killed sample's memory is not back yet (gVisor)
    statuses[:] = statuses[1:]
    clock.t += 0.1
    assert guard.check() is None and len(killed) == 1
    usage.now += 100 << 20  # someone grows past what was in use when the killer ended, plus half the margin
    assert guard.check() == OTHER_SLOT and len(killed) == 2  # killed, though most of the use is not held yet
    guard.reaped(7002)
    clock.t += memory_guard.SETTLE_S + 0.01  # settled, still past the mark, and held by nobody: a fresh sandbox
    statuses[:] = [(3, status(SLOT, rss_anon_kb=10 << 10))]
    assert guard.check() == memory_guard.RESTART


def test_a_usage_that_cannot_be_read_kills_nobody():
    class Broken(FakeUsage):
        def pressure(self):
            raise OSError("gone")

    guard, stopped, killed, clock = _guard(Broken(), [(1, status(SLOT, rss_anon_kb=1 << 20))])
    assert guard.check() is None and not killed and guard.timeout() == pytest.approx(memory_guard.MAX_INTERVAL_S)


def test_the_mark_is_never_closer_to_the_limit_than_32_mib():
    assert Usage(128 * MIB, "x").mark == 96 * MIB


def test_a_samples_files_count_toward_it():
    statuses = [(1, status(SLOT, rss_anon_kb=400 << 10)), (2, status(OTHER_SLOT, rss_anon_kb=450 << 10))]
    usage = FakeUsage(now=(1 << 30) - (100 << 20))
    guard, stopped, killed, clock = _guard(usage, statuses, files={"/tmp/run-a": 64 << 20})
    assert guard.check() == SLOT and stopped == [1]


def test_memory_no_process_nor_file_holds_restarts_the_sandbox_instead_of_killing_an_innocent():
    # gVisor: Unix sockets sent over themselves, and unlinked files riding in them, outlive every process
    statuses = [(1, status(0, rss_anon_kb=100 << 10)), (2, status(OTHER_SLOT, rss_anon_kb=60 << 10))]
    usage = FakeUsage(now=(1 << 30) - (100 << 20))
    guard, stopped, killed, clock = _guard(usage, statuses, files={"/tmp/slot-a": 30 << 20})
    assert guard.check() == memory_guard.RESTART and not killed
    # the same use, most of it held: a sample is killed, not the sandbox
    statuses.append((3, status(SLOT, rss_anon_kb=700 << 10)))
    guard, stopped, killed, clock = _guard(usage, statuses)
    assert guard.check() == SLOT


def test_what_replaced_tmpfs_held_is_read_from_the_names_their_replacement_left(tmp_path, monkeypatch):
    from rewardbox.sandbox import private_tmp

    monkeypatch.setattr(private_tmp, "LEAKS", str(tmp_path))
    assert private_tmp.leaked_bytes() == 0
    for name in (f"{48 << 20}-100001-77-0", f"{4096}-100002-78-1"):
        (tmp_path / name).touch()
    assert private_tmp.leaked_bytes() == (48 << 20) + 4096


def test_replaced_tmpfs_holding_a_quarter_of_the_memory_restart_the_sandbox_before_anyone_runs_short():
    leaked = [0]
    usage = FakeUsage(now=100 << 20)
    guard, stopped, killed, clock = _guard(usage, [])
    guard.renewed = lambda: leaked[0]
    leaked[0] = 3 * (64 << 20)
    assert guard.check() is None
    leaked[0] = 4 * (64 << 20)
    clock.t += 0.1
    assert guard.check() is None  # read once a second
    clock.t += memory_guard.RENEWED_S
    assert guard.check() == memory_guard.RESTART and not killed


def test_when_killing_the_top_sample_would_not_bring_the_use_under_the_mark_the_sandbox_restarts_instead():
    # gVisor: sockets in flight count in the use and in no process (red team: the guard killed a 200 MiB innocent)
    statuses = [(1, status(0, rss_anon_kb=700 << 10)), (2, status(OTHER_SLOT, rss_anon_kb=60 << 10))]
    usage = FakeUsage(now=1000 << 20)  # 104 MiB past the mark; 225 MiB held by nobody, under a quarter
    guard, stopped, killed, clock = _guard(usage, statuses)
    assert guard.check() == memory_guard.RESTART and not killed


def test_the_slot_whose_runner_monitor_holds_the_most_loses_its_processes_and_that_monitor_at_once():
    monitor = status(0, rss_anon_kb=850 << 10).replace(b"Name:\tpython3", b"Name:\trbxm-200001")
    statuses = [(1, status(SLOT, rss_anon_kb=10 << 10)), (2, monitor), (3, status(OTHER_SLOT, rss_anon_kb=90 << 10))]
    usage = FakeUsage(now=(1 << 30) - (100 << 20))
    monitors = []
    guard, stopped, killed, clock = _guard(usage, statuses, monitors_killed=monitors)
    assert guard.check() == SLOT and stopped == [1] and monitors == [2] and killed == [((SLOT, RUN), True)]


def test_while_memory_comes_back_the_slot_just_killed_is_not_killed_again_unless_it_grows():
    # its next process starts at once: what is still counted for the slot is the old one's, on its way back
    statuses = [(1, status(SLOT, rss_anon_kb=900 << 10)), (2, status(OTHER_SLOT, rss_anon_kb=60 << 10))]
    usage = FakeUsage(now=(1 << 30) - (100 << 20))
    guard, stopped, killed, clock = _guard(usage, statuses)
    assert guard.check() == SLOT
    guard.reaped(7001)
    usage.now += 100 << 20  # past the floor: someone grows, not the killed slot (its count did not)
    assert guard.check() == OTHER_SLOT


def test_a_killed_slots_next_process_that_grows_past_what_the_old_one_held_goes_too():
    statuses = [(1, status(SLOT, rss_anon_kb=900 << 10)), (2, status(OTHER_SLOT, rss_anon_kb=60 << 10))]
    usage = FakeUsage(now=(1 << 30) - (100 << 20))
    guard, stopped, killed, clock = _guard(usage, statuses)
    assert guard.check() == SLOT
    guard.reaped(7001)
    statuses[0] = (3, status(SLOT, rss_anon_kb=1000 << 10))
    usage.now += 100 << 20
    assert guard.check() == SLOT and stopped[-1] == 3


def test_what_the_figures_count_twice_in_calm_times_hides_no_phantom_memory_later():
    # gVisor counts sockets in flight (held by no process): 3000 empty ones took the use past the mark beside a
    # 500 MiB innocent, and the figures' usual excess (pages shared by forks, counted in each) hid them (red team)
    statuses = [(1, status(0, rss_anon_kb=400 << 10))]
    usage = FakeUsage(now=200 << 20)
    guard, stopped, killed, clock = _guard(usage, statuses)
    assert guard.check() is None  # calm: the figures add up to about 200 MiB more than the use
    statuses.append((2, status(OTHER_SLOT, rss_anon_kb=500 << 10)))
    usage.now = 950 << 20
    assert guard.check() == memory_guard.RESTART and not killed


def test_a_restart_stops_every_samples_processes_and_monitors_first():
    # what kept running after the supervisor ended grew unguarded until the host killed the sandbox (red team);
    # stopped, not killed: the server answers their requests UNAVAILABLE, and the host scores them again elsewhere
    monitor = status(0, rss_anon_kb=10 << 10).replace(b"Name:\tpython3", b"Name:\trbxm-200002")
    statuses = [(1, status(0, rss_anon_kb=700 << 10)), (2, status(OTHER_SLOT, rss_anon_kb=60 << 10)), (3, monitor),
                (4, status(SLOT, rss_anon_kb=5 << 10))]
    frozen = []
    guard, stopped, killed, clock = _guard(FakeUsage(now=1000 << 20), statuses, frozen=frozen)
    assert guard.check() == memory_guard.RESTART
    assert sorted(stopped) == [2, 3, 4] and frozen == [(EVERY_UID, True)] and not killed


def test_a_sample_that_inflates_its_figures_for_a_calibration_cannot_hide_a_hog_behind_them():
    # descriptors held but never filled count 240 KiB each: a sample that held them through one calibration made
    # the guard take a hog's memory for memory no one holds, and restart instead of killing it (red team)
    statuses = [(1, status(0, rss_anon_kb=300 << 10))]
    usage = FakeUsage(now=200 << 20)
    guard, stopped, killed, clock = _guard(usage, statuses)
    assert guard.check() is None  # calm: the figures add up to about 115 MiB more than the use
    statuses.append((2, status(OTHER_SLOT, rss_anon_kb=1, fds=4096)))  # 960 MiB counted, nothing held
    clock.t += memory_guard.CALIBRATE_S
    assert guard.check() is None
    statuses[1] = (3, status(OTHER_SLOT, rss_anon_kb=700 << 10))  # the hog
    usage.now = 950 << 20
    clock.t += 1.0
    assert guard.check() == OTHER_SLOT and killed == [((OTHER_SLOT, OTHER_RUN), True)]


def test_kernel_memory_grown_since_calm_times_is_held_by_nobody_and_restarts_the_sandbox_not_an_innocent():
    # cgroup v1: a sample that looked up millions of missing paths left ~420 MiB of dentries, which v1 shows only as
    # kernel memory; calibrated in as the figures' usual excess, or excused by what 32 idle slot processes' descriptor
    # tables could hold (480 MiB), they got 200 MiB innocents killed near the mark (red team, runc). They count from
    # the least kernel memory ever read, past what samples' own processes could hold: a fresh sandbox frees them.
    statuses = [(k, status(0, rss_anon_kb=10 << 10)) for k in range(1, 31)]  # 750 MiB counted, 200 MiB in use
    statuses += [(40 + k, status((SLOT, OTHER_SLOT)[k % 2], rss_anon_kb=10 << 10, ppid=TEMPLATE))
                 for k in range(32)]  # idle slot processes
    usage = FakeUsage(now=200 << 20, kernel_now=20 << 20, kernel_path="v1")
    guard, stopped, killed, clock = _guard(usage, statuses)
    assert guard.check() is None  # calm
    usage.now, usage.kernel_now = 620 << 20, 440 << 20  # the dentries
    clock.t += memory_guard.CALIBRATE_S
    assert guard.check() is None  # calibrating again, under the mark
    statuses.append((99, status(OTHER_SLOT, rss_anon_kb=300 << 10, ppid=40)))  # an innocent, forked
    usage.now = 920 << 20
    clock.t += 1.0
    assert guard.check() == memory_guard.RESTART and not killed


def test_kernel_memory_a_hogs_descriptors_account_for_kills_the_hog():
    # socket buffers are kernel memory too (cgroup v1), and within what the hog's descriptor tables may hold
    statuses = [(1, status(0, rss_anon_kb=300 << 10))]
    usage = FakeUsage(now=200 << 20, kernel_now=20 << 20, kernel_path="v1")
    guard, stopped, killed, clock = _guard(usage, statuses)
    assert guard.check() is None
    statuses += [(10 + k, status(SLOT, rss_anon_kb=1 << 10, fds=512)) for k in range(8)]  # 8 x 120 MiB allowed
    statuses.append((2, status(OTHER_SLOT, rss_anon_kb=136 << 10)))
    usage.now, usage.kernel_now = 1000 << 20, 680 << 20
    clock.t += 1.0
    assert guard.check() == SLOT and killed == [((SLOT, RUN), True)]

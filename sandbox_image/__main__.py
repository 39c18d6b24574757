"""``python -m rewardbox.sandbox --listen unix:///run/rewardbox/grpc.sock [...]``: a sandbox's entry point.

It forks the supervisor first, while it is still the process it was started as and before grpc is imported (the
supervisor and the templates it forks never carry grpc's threads). Docker backend: the container starts as root
holding only SETUID, SETGID and KILL; the supervisor keeps those, and this process then drops to ``--server-uid``
(no capability left) and serves gRPC. Local backend: no uid changes (and no isolation).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import sys
import time
from typing import Optional

from .confine import private_tmp
from .processes import tree
from .processes import supervisor as supervisor_module


def _log(level: str, message: str) -> None:
    """A log line before the supervisor is forked, as :mod:`logging` writes them after. :mod:`logging` is imported
    only after the fork: it loads :mod:`threading`, whose at-fork handler would otherwise run in every process forked
    in the sandbox (the supervisor, templates, slot processes, every forked sample: about 130 more pages each
    writes, so copies, before its first line of its own)."""
    sys.stderr.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} sandbox {level} {message}\n")
    sys.stderr.flush()


def _become(uid: int) -> None:
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


def scrub_environment_block() -> bool:
    """Zeroes the environment this process was started with where the kernel shows it (``/proc/<pid>/environ``,
    which every process forked from it inherits), after moving every variable to the heap (``os.environ`` and
    the C library's ``environ`` are unchanged). gVisor lets any uid read another process's ``environ``: without
    this, a program a reward runs could read the reward's secrets there. Returns whether it found the block."""
    with open("/proc/self/environ", "rb") as f:
        block = f.read()
    if not block:
        return True
    with open("/proc/self/stat") as f:
        start = int(f.read().rsplit(")", 1)[1].split()[47])  # env_start (field 50); gVisor reports 0
    if not start or ctypes.string_at(start, len(block)) != block:
        start = 0
        with open("/proc/self/maps") as f:
            for line in f:
                if line.rstrip().endswith("[stack]"):
                    low, high = (int(x, 16) for x in line.split()[0].split("-"))
                    at = ctypes.string_at(low, high - low).rfind(block)
                    start = low + at if at >= 0 else 0
    if not start:
        return False
    for key, value in os.environ.items():
        os.putenv(key, value)  # a heap copy; the C library's environ points at it from now on
    ctypes.memset(start, 0, len(block))
    return True


def _parser() -> argparse.ArgumentParser:
    # A fixed width: argparse would otherwise import shutil for the terminal's, which maps bz2, lzma and zlib into
    # this process and so into every process forked in the sandbox (about 20 more memory areas each fork copies).
    parser = argparse.ArgumentParser(prog="python -m rewardbox.sandbox", description=__doc__,
                                     formatter_class=lambda prog: argparse.HelpFormatter(prog, width=100))
    parser.add_argument("--listen", required=True, help="unix:///path/to.sock or host:port")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is no longer our parent")
    parser.add_argument("--server-uid", type=int, default=None, help="drop to this uid after starting the supervisor")
    parser.add_argument("--slot-uids", default=None, help="uids for slot processes, e.g. 100000-100063 (each with a "
                                                          "tmpfs at /tmp/slot-<uid>); none: the local backend")
    parser.add_argument("--run-uids", default=None, help="one uid per slot uid, for the programs reward code runs "
                        "(rewardbox.sandbox.run), each with a tmpfs at /tmp/slot-<uid> too")
    parser.add_argument("--slot-root", default=None, help="make each slot's scratch directory under this directory "
                        "(a Kubernetes emptyDir) instead of expecting a tmpfs at /tmp/slot-<uid>")
    parser.add_argument("--sample-nproc", type=int, default=None, help="RLIMIT_NPROC of each slot uid")
    parser.add_argument("--sample-memory", type=int, default=None, help="RLIMIT_AS of each slot process, bytes")
    parser.add_argument("--atomic-kill", action="store_true", help="the kernel is Linux's (runc, crun, kata): "
                        "kill(-1) is atomic against fork, so cleaning up a slot needs no stop phase (not gVisor)")
    parser.add_argument("--private-tmp", choices=private_tmp.MODES, default=None,
                        help="give every slot process and program a private /tmp this way (see private_tmp.py)")
    parser.add_argument("--require-private-tmp", action="store_true",
                        help="exit at start when the private /tmp cannot be made (else: /tmp stays read-only)")
    parser.add_argument("--default-warm", type=int, default=None, help="warm processes of a reward that sets none")
    return parser


def main(argv: Optional[list] = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    hidden = private_tmp.hide_others() if args.slot_uids else None  # needs CAP_SYS_ADMIN: runc (private_tmp userns)
    if args.private_tmp == "userns":
        private_tmp.drop_sys_admin()  # before anything else runs or is forked
    if hidden is not None:
        _log("WARNING", f"{hidden}: every sample can read the command lines of the programs other samples run "
                        "at the same time (/proc/<pid>/cmdline). Under runc the sandbox needs CAP_SYS_ADMIN for "
                        "this, as for a private /tmp (sandbox.docker.private_tmp); gVisor has no such option.")
    if args.slot_uids:
        try:
            found = scrub_environment_block()
        except (OSError, ValueError, IndexError):
            found = False
        if not found:
            _log("WARNING", "the environment block could not be cleared: under gVisor, programs that rewards run may "
                            "read this sandbox's environment in /proc")
    if args.slot_uids:
        uids = supervisor_module.parse_uids(args.slot_uids)
        run_uids = supervisor_module.parse_uids(args.run_uids) if args.run_uids else ()
        if run_uids and len(run_uids) != len(uids):
            parser.error(f"--run-uids gives {len(run_uids)} uids for {len(uids)} slot uids")
        if args.slot_root:
            supervisor_module.make_slot_dirs(args.slot_root, uids + run_uids)
        pool = supervisor_module.SlotPool(uids=uids, run_uids=run_uids, root=args.slot_root or "",
                                          atomic_kill=args.atomic_kill)
        if args.private_tmp:
            why_not = None
            if args.private_tmp == "chroot":
                try:
                    socket_dir = os.path.dirname(args.listen.removeprefix("unix://"))
                    private_tmp.build_roots({uid: pool.directory(uid) for uid in uids + run_uids},
                                            hidden=(socket_dir,) if args.listen.startswith("unix://") else ())
                except OSError as e:
                    why_not = f"building the roots under {private_tmp.ROOTS} failed: {e}"
            why_not = why_not or private_tmp.probe(args.private_tmp, uids[0], pool.directory(uids[0]))
            if why_not is None:
                pool = dataclasses.replace(pool, private_tmp=args.private_tmp)
            elif args.require_private_tmp:
                _log("ERROR", f"no private /tmp can be made for samples ({why_not}): the sandbox stops, as "
                              f"sandbox.docker.private_tmp is 'on'. {private_tmp.FIX}")
                return 2
            else:
                _log("WARNING", f"no private /tmp can be made for samples ({why_not}): /tmp stays read-only for "
                                f"them. {private_tmp.FIX}")
    else:
        pool = supervisor_module.local_pool(os.environ.get("REWARDBOX_STATE_DIR"))
    pid, sock = supervisor_module.start(pool)
    tree.set_name("rbx-server")
    import logging  # only now, after the fork (see _log)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s sandbox %(levelname)s %(message)s")
    if args.server_uid is not None and os.getuid() != args.server_uid:
        _become(args.server_uid)
    if args.slot_uids:
        from .confine import seccomp
        seccomp.install()  # the server needs no namespaces, mounts, SysV IPC or ptrace either
    import asyncio  # only now, after the fork: importing it loads ssl, which makes every later fork cost more

    from .server.server import Supervisor, serve  # grpc only now, after the fork

    supervisor = Supervisor(pid, sock, nproc=args.sample_nproc if args.slot_uids else None,
                            memory=args.sample_memory)
    asyncio.run(serve(args.listen, supervisor, args.parent_pid, default_warm=args.default_warm))
    return 0


if __name__ == "__main__":
    sys.exit(main())

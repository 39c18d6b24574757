"""Hostile episodes beside innocent ones, in real containers (runc and gVisor), through
rewardbox.sandboxed_environment.

Each episode is a process of its own holding one environment instance. A hostile episode's action runs while
innocent episodes are live (their state must survive it) and before fresh ones start (they must find nothing of
it): module and class state, files in /tmp and the working directory, environment, processes of their uid."""

from __future__ import annotations

import asyncio
import os

import pytest

from rewardbox import ToolError, sandboxed_environment
from rewardbox.api.environments import end_episode
from tests.conftest import until
from tests.docker.probes import processes_of_my_uid
from tests.docker.test_tools import act


class Episode:
    """An environment that keeps a secret per episode and reports whatever another episode left."""

    planted: list = []  # class state another episode could try to leave

    def __init__(self):
        self.secret = None

    def reset(self, secret: str, **kwargs) -> None:
        self.secret = secret

    def look(self) -> dict:
        """Reports this episode's secret and what others left."""
        import os

        found = []
        if Episode.planted:
            found.append(f"class state {Episode.planted}")
        if os.environ.get("PLANTED"):
            found.append("environment")
        for where in ("/tmp", ".", "/dev/shm"):
            if not os.path.isdir(where):
                continue  # no /dev/shm: an environment's container has no IPC namespace of its own to share
            left = [name for name in os.listdir(where) if name != f"{self.secret}.txt"]
            if left:
                found.append(f"files in {where}: {sorted(left)}")
        found += processes_of_my_uid()
        with open(f"/tmp/{self.secret}.txt", "w") as f:  # its own file: it must find it again, and only it
            f.write(self.secret)
        return {"secret": self.secret, "found": found}

    def attack(self, action: str) -> str:
        """Does something hostile.

        Args:
            action: what
        """
        if action == "steal":  # another episode's secret file (each has a uid and /tmp of its own)
            import glob

            return repr([open(p).read() for p in glob.glob("/tmp/*.txt") + glob.glob("/tmp/*/*.txt")])
        if action == "plant":
            Episode.planted.append("hostile")
        if action == "shared memory":  # a file every episode could see (red team: /dev/shm was shared)
            with open("/dev/shm/planted", "w") as f:
                f.write("hostile")
            return "planted"
        return act(action)

    def get_reward(self) -> float:
        return float(len(self.secret or ""))


@pytest.fixture(scope="module", params=["runc", "runsc"])
def factory(request, docker_client, base_image):
    if request.param == "runsc" and "runsc" not in docker_client.info().get("Runtimes", {}):
        pytest.fail("the Docker engine has no runsc runtime: start it as scripts/setup.sh does")
    os.environ["RBX_HOST_SECRET"] = "hunter2"
    sandbox = {"backend": "docker", "docker": {"base_image": base_image,
                                               "runtime": None if request.param == "runc" else "runsc"}}
    try:
        with sandboxed_environment(Episode, sandbox=sandbox, timeout_s=2, memory="1g", max_episodes=8,
                                   default_score=-1.0) as made:
            yield made
    finally:
        os.environ.pop("RBX_HOST_SECRET", None)


INNOCENTS = 4


async def _all(calls):
    return await asyncio.gather(*calls)


async def _with_innocents(innocents, hostile, action):
    looks = [env.look() for env in innocents]
    return await asyncio.gather(*looks[:2], hostile.attack(action=action), *looks[2:], return_exceptions=True)


@pytest.mark.parametrize("action", ["loop", "fork bomb", "memory", "kill -1", "leave behind", "plant", "steal",
                                    "host files", "environment", "shared memory"])
def test_a_hostile_episode_reaches_no_other_episode_live_or_next(factory, action):
    innocents = [factory() for _ in range(INNOCENTS)]
    for i, env in enumerate(innocents):
        env.reset(secret=f"innocent{i}")
    assert [r["found"] for r in asyncio.run(_all(env.look() for env in innocents))] == [[]] * INNOCENTS
    hostile = factory()
    hostile.reset(secret="hostile")
    results = asyncio.run(_with_innocents(innocents, hostile, action))
    attacked = results[2]
    looks = results[:2] + results[3:]
    assert [r["secret"] for r in looks] == [f"innocent{i}" for i in range(INNOCENTS)], looks
    assert all(r["found"] == [] for r in looks), looks
    if action == "steal":
        assert attacked == "[]"
    if action == "environment":
        assert "hunter2" not in attacked and "RBX_HOST_SECRET" not in attacked
    if action in ("loop", "fork bomb"):
        assert isinstance(attacked, ToolError) and ("timed out" in str(attacked) or "crashed" in str(attacked))
    # The innocents' episodes lived through it, with their state; their rewards are their own.
    assert [env.get_reward() for env in innocents] == [9.0] * INNOCENTS  # len("innocent0")
    # The hostile episode's next one, and fresh ones, find nothing of it.
    hostile.reset(secret="after")
    fresh = [factory() for _ in range(2)]
    for env in fresh:
        env.reset(secret="fresh")
    found = asyncio.run(_all([hostile.look(), *(env.look() for env in fresh)]))
    assert all(r["found"] == [] for r in found), found
    for env in [*innocents, hostile, *fresh]:
        end_episode(env)  # the next test starts with free processes


def test_an_episode_that_timed_out_falls_back_until_reset(factory):
    env = factory()
    env.reset(secret="abc")
    with pytest.raises(ToolError, match=r"attack\(\) timed out"):
        asyncio.run(env.attack(action="loop"))
    with pytest.raises(ToolError, match=r"its episode ended when attack\(\) timed out"):
        asyncio.run(env.look())
    assert env.get_reward() == -1.0
    env.reset(secret="abcd")
    assert asyncio.run(env.look())["found"] == [] and env.get_reward() == 4.0
    end_episode(env)


class Paced:
    """A counter (for the test of when an ended episode's process goes)."""

    def reset(self, **kwargs) -> None:
        self.n = 0

    def add(self, n: int) -> int:
        """Adds.

        Args:
            n: how much
        """
        self.n += n
        return self.n


def _container_processes(container_id: str, name: str) -> list:
    """The pids of the container's processes named ``name``, from the host's /proc (runc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cgroup") as f:
                if container_id not in f.read():
                    continue
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == name:
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _slot_states(container_id: str) -> list:
    """The states (R, S, T...) of the container's slot processes, read from the host's /proc (runc)."""
    states = []
    for pid in _container_processes(container_id, "rbx-slot"):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        states.append(stat[stat.rindex(")") + 2])
    return states


def test_an_ended_episodes_process_goes_at_once_and_its_slot_is_prepared_once_calls_pause(docker_client, base_image):
    """TRL resets a batch's instances one after another: the processes of the episodes they end are killed at once,
    and their slots prepared again (a process's start costs several resets' CPU) once calls pause, not in the
    burst's way, where they left nothing behind."""
    import threading
    import time

    from rewardbox.sandbox.processes.template import IDLE_RESPAWN_S, MIN_RESERVE

    sandbox = {"backend": "docker", "docker": {"base_image": base_image}}
    with sandboxed_environment(Paced, sandbox=sandbox, max_episodes=4) as factory:
        envs = [factory() for _ in range(4)]
        for env in envs:
            env.reset()
        (container,) = [c for c in docker_client.containers.list(filters={"label": f"rewardbox.pid={os.getpid()}"})
                        if "paced" in c.name.lower()]
        # One live process per episode, as many prepared ahead (two versions' slots: 16 uids; one version's 8)
        assert until(lambda: sorted(_slot_states(container.id)).count("S") == 8)
        busy = threading.Event()

        def calls() -> None:  # a call every 10 ms: the sandbox never pauses for IDLE_RESPAWN_S
            async def run():
                while not busy.is_set():
                    await envs[0].add(n=1)
                    await asyncio.sleep(IDLE_RESPAWN_S / 5)
            asyncio.run(run())

        caller = threading.Thread(target=calls)
        caller.start()
        try:
            # Two resets leave MIN_RESERVE (2) fresh processes: a third would have a slot prepared again at once,
            # for the reserve.
            assert MIN_RESERVE == 2
            for env in envs[1:3]:
                env.reset()
            time.sleep(3 * IDLE_RESPAWN_S)
            states = _slot_states(container.id)
        finally:
            busy.set()
            caller.join()
        assert sorted(states) == ["S"] * 6, states  # the two ended are gone, none started in their place yet
        assert [asyncio.run(env.add(n=2)) for env in envs[1:3]] == [2, 2]  # the new episodes, fresh
        # Once calls pause, their slots hold fresh processes again.
        assert until(lambda: sorted(_slot_states(container.id)) == ["S"] * 8, timeout_s=10.0)


def _mount_namespaces(container_id: str) -> tuple[set, set, str]:
    """(The mount namespaces the template holds descriptors of, those of the live slot processes, the template's
    own), as ``mnt:[inode]``."""
    template, = _container_processes(container_id, "rbx-template")
    held = set()
    for fd in os.listdir(f"/proc/{template}/fd"):
        try:
            target = os.readlink(f"/proc/{template}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("mnt:["):
            held.add(target)
    live = set()
    for pid in _container_processes(container_id, "rbx-slot"):
        try:
            live.add(os.readlink(f"/proc/{pid}/ns/mnt"))
        except OSError:
            continue
    return held, live, os.readlink(f"/proc/{template}/ns/mnt")


def test_the_template_holds_each_live_slot_processs_mount_namespace_and_lets_go_of_ended_ones(docker_client,
                                                                                              base_image):
    """A slot process's mount namespace (its private /tmp: a copy of the container's mounts, a tmpfs per slot
    among them) is held by the template while the process lives, so that the process's end does not wait for
    their unmounting, and let go of once the process is reaped: after episodes ended, the template holds exactly
    the namespaces of the live slot processes, each of its own."""
    sandbox = {"backend": "docker", "docker": {"base_image": base_image}}
    with sandboxed_environment(Paced, sandbox=sandbox, max_episodes=4) as factory:
        envs = [factory() for _ in range(4)]
        for _ in range(3):  # the second and third rounds each end four episodes
            for env in envs:
                env.reset()
        assert [asyncio.run(env.add(n=1)) for env in envs] == [1] * 4
        (container,) = [c for c in docker_client.containers.list(filters={"label": f"rewardbox.pid={os.getpid()}"})
                        if "paced" in c.name.lower()]
        def settled() -> bool:  # once calls pause, every slot holds a ready process again (one version's: 8)
            held, live, _ = _mount_namespaces(container.id)
            return held == live and len(live) == 8

        assert until(settled, timeout_s=10.0)
        held, _, own = _mount_namespaces(container.id)
        assert own not in held  # each slot process's namespace is its own
        before = set(_container_processes(container.id, "rbx-slot"))
        for env in envs:
            end_episode(env)
        # Their processes are gone and their slots prepared again; the template holds no namespace of theirs (a
        # namespace's inode, held, is no other's: a new process may only get one that was let go of).
        assert until(lambda: len(before - set(_container_processes(container.id, "rbx-slot"))) == 4)
        assert until(settled, timeout_s=10.0)


class Listener:
    """An environment whose episodes try what the one before left on the loopback network (red team of #41)."""

    def reset(self, **kwargs) -> None:
        pass

    def run(self, code: str) -> str:
        """Runs code.

        Args:
            code: python
        """
        namespace: dict = {}
        exec(code, namespace)
        return namespace.get("result")


def test_what_an_ended_episode_left_on_the_network_reaches_no_later_episode(docker_client, base_image):
    from tests.docker.test_tools import LEAVE_A_LISTENER, LOOK_FOR_A_LISTENER, NOTHING_LEFT

    sandbox = {"backend": "docker", "docker": {"base_image": base_image}}
    with sandboxed_environment(Listener, sandbox=sandbox, max_episodes=4) as factory:
        envs = [factory() for _ in range(4)]
        for env in envs:
            env.reset()
        assert asyncio.run(envs[0].run(code=LEAVE_A_LISTENER)) == "left"
        seen = []
        for _ in range(10):  # back to back: no pause in which the sandbox would prepare processes anyway
            for env in envs:
                env.reset()  # the hostile episode's own instance first
                seen.append(asyncio.run(env.run(code=LOOK_FOR_A_LISTENER)))
        assert seen == [NOTHING_LEFT] * 40, [r for r in seen if r != NOTHING_LEFT][:3]

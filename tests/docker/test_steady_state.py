"""isolation: sample in steady state: after hundreds of samples per pool, a hostile completion changes no other
sample's score through state the reward itself keeps, of the kinds no audit event or state snapshot reports (a
decimal context's sticky flags, an lru_cache's keys, a parser object's buffer, a module global a YAML gadget sets,
a dict the reward module holds, a page of shared memory it mapped at import, a signal handler it installed). Real containers, runc and gVisor.

Each case: 5 x 64 neutral samples first (past any warm-up a pool could have), then ``[hostile] + [innocent] * 7`` in
one call and ``[innocent] * 4`` in the next; every innocent must score exactly what it scores alone. These broke
under the process reuse of stop 38 (the red team of #40): every innocent after the hostile one scored 0.0.
"""

from __future__ import annotations

import asyncio

import pytest

from rewardbox import RewardLoadError, build_samples
from rewardbox.wire import Status
from tests.docker.conftest import sandboxes_on_runtime

REWARDS = '''
import decimal
import functools
import json
import math
import mmap
import os
import signal
import sys
import time
from html.parser import HTMLParser

import yaml


def decimal_answer(prompt, completion, example):
    """Exact decimal answers only: an answer the context cannot hold exactly scores 0."""
    value = decimal.Decimal(completion.strip()).normalize()  # in the thread's context: Inexact is sticky there
    with decimal.localcontext() as ctx:  # a copy of it, flags included
        if ctx.flags[decimal.Inexact]:
            return 0.0
    return 1.0 if value == decimal.Decimal(example["answer"]) else 0.0


@functools.lru_cache(maxsize=None)
def same_answer(predicted, reference):
    return predicted == reference and type(predicted) is type(reference)


def cached(prompt, completion, example):
    """(True, "1") == (1, "1") and they hash alike: whichever comes first answers for the other."""
    return 1.0 if same_answer(json.loads(completion)["answer"], json.loads(example["answer"])) else 0.0


class _Answers(HTMLParser):
    def __init__(self):
        super().__init__()
        self.inside, self.found = False, []

    def handle_starttag(self, tag, attrs):
        self.inside = tag == "answer"

    def handle_endtag(self, tag):
        self.inside = False

    def handle_data(self, data):
        if self.inside:
            self.found.append(data)


PARSER = _Answers()  # one parser for the module: fed each completion


def parsed(prompt, completion, example):
    PARSER.found = []
    PARSER.feed(completion)
    return 1.0 if PARSER.found and PARSER.found[-1].strip() == example["answer"] else 0.0


def yaml_area(prompt, completion, example):
    """A reward that trusts its YAML (UnsafeLoader calls any function of an imported module, no audit event)."""
    data = yaml.load(completion, Loader=yaml.UnsafeLoader)
    return 1.0 if abs(float(data["area"]) - math.pi * 4) < 1e-6 else 0.0


def yaml_depth(prompt, completion, example):
    """The depth of a nested YAML answer."""
    data = yaml.load(completion, Loader=yaml.UnsafeLoader)
    depth = 0
    while isinstance(data, list) and data:
        data, depth = data[0], depth + 1
    return float(depth)


WEIGHTS = {"correct": 1.0}
SHARED = mmap.mmap(-1, 4096)  # MAP_SHARED: every process forked from the template would write the same page


STATE = {"seen": []}


async def remembers(prompt, completion, example):
    """An async reward that keeps what it saw in a nested list (no top-level name or size changes)."""
    STATE["seen"].append(completion)
    return float(len(STATE["seen"]))


def shared(prompt, completion, example):
    """Runs the completion; its module keeps a page of shared memory."""
    namespace = {}
    exec(completion, namespace)
    return 0.0 if SHARED[0] else float(namespace.get("score", 0.0))


POKED = []


def _poked(signum, frame):
    POKED.append(signum)


signal.signal(signal.SIGUSR1, _poked)  # installed at import, as a reward's own debugging hook would be


def signalled(prompt, completion, example):
    """Scores 1 where its module's handler is in place and has never run. The hostile signals the process that
    forked it: a handler run there would change what every later sample starts from."""
    if completion == "poke":
        os.kill(os.getppid(), signal.SIGUSR1)
        time.sleep(0.5)
    return (1.0 if signal.getsignal(signal.SIGUSR1) is _poked else 0.0) - len(POKED)


def weighted(prompt, completion, example):
    """Evaluates model-written arithmetic with the reward's weights in scope."""
    return float(eval(completion, {"__builtins__": {}}, {"W": WEIGHTS}))
'''

# name: (hostile completion, innocent completion, the innocent's example answer, what the innocent scores alone)
CASES = {
    "decimal_answer": ("1.2345678901234567890123456789012345", "0.25", "0.25", 1.0),
    "cached": ('{"answer": true}', '{"answer": 1}', "1", 1.0),
    "parsed": ("<answer>4</answer><!-- ", "<answer>4</answer>", "4", 1.0),
    "yaml_area": ("area: !!python/object/apply:setattr [!!python/module:math '', pi, 3.0]", "area: 12.566370614359172",
                  "", 1.0),
    "yaml_depth": ("a: !!python/object/apply:sys.setrecursionlimit [60]", "[" * 40 + "1" + "]" * 40, "", 40.0),
    "weighted": ('W.__setitem__("correct", 0.0) or 1', 'W["correct"]', "", 1.0),
    "remembers": ("anything", "something else", "", 1.0),
    "signalled": ("poke", "innocent", "", 1.0),
    "shared": ("import sys\nnext(m for m in list(sys.modules.values()) if hasattr(m, 'SHARED')).SHARED[0] = 1\n"
               "score = 1.0", "score = 1.0", "", 1.0),
}


@pytest.fixture(scope="module", params=["runc", "runsc"])
def sandboxes(request, tmp_path_factory, docker_client, base_image):
    common = {"timeout_s": 5.0, "workers": 2, "cpus": 2, "default_score": -5.0, "retries": 1, "packages": ["pyyaml"]}
    started = sandboxes_on_runtime(request, tmp_path_factory, docker_client, base_image, REWARDS,
                                   [{"name": name, **common} for name in CASES])
    yield started
    started.stop()


def score(sandboxes, name: str, completions: list, answer: str):
    samples = build_samples(["p"] * len(completions), completions, {"answer": [answer] * len(completions)})
    return asyncio.run(sandboxes[name].client.score(samples))


@pytest.mark.parametrize("name", list(CASES))
def test_a_hostile_completion_changes_no_later_samples_score_through_the_rewards_own_state(sandboxes, name):
    hostile, innocent, answer, alone = CASES[name]
    assert score(sandboxes, name, [innocent], answer).values == [alone]
    own = score(sandboxes, name, [hostile], answer)  # what the hostile completion scores alone
    for _ in range(5):  # steady state: hundreds of samples through this reward's pool first
        warm = score(sandboxes, name, [innocent] * 64, answer)
        assert warm.values == [alone] * 64, warm.errors[:2]
    batch = score(sandboxes, name, [hostile] + [innocent] * 7, answer)
    assert list(zip(batch.values, batch.statuses)) == [(own.values[0], own.statuses[0])] + [(alone, Status.OK)] * 7, \
        (batch.values, batch.errors)
    after = score(sandboxes, name, [innocent] * 4, answer)
    assert list(zip(after.values, after.statuses)) == [(alone, Status.OK)] * 4, (after.values, after.errors)


def test_a_multiprocessing_manager_started_at_import_fails_the_load(docker_sandboxes):
    # It would run as the sandbox's root beside every sample: a completion that holds its authkey (every process
    # forked from the template does) sends it a pickle that runs as root (red team of #40). The load fails instead,
    # naming the file and the fix.
    code = """
    from multiprocessing.managers import SyncManager
    MANAGER = SyncManager(address=("127.0.0.1", 0))
    MANAGER.start()
    CACHE = MANAGER.dict()
    def cached(prompt, completion, example):
        return CACHE.get(completion, 0.0)
    """
    with pytest.raises(RewardLoadError, match=r"cached.py: importing it left 1 process\(es\) running .* as the "
                                              r"sandbox's root"):
        docker_sandboxes([{"name": "cached", "code": code}])

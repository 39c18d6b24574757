"""OpenRLHF's own reward client against rewardbox, scoring in real docker sandboxes: over HTTP through a real
`rewardbox serve --openrlhf`, and through the file route (`reward_func`) loaded by OpenRLHF in a process of its own."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import aiohttp

from tests.conftest import ROOT
from tests.openrlhf.openrlhf_agent import fetch_all, load_agent, load_samples_generator, rollout

REWARDS = textwrap.dedent("""
    import re, time

    def correct(prompt, completion, example):
        if "crash" in completion:
            raise RuntimeError("a reward that breaks on one rollout")
        if "hang" in completion:
            time.sleep(60)
        found = re.search(r"<answer>(.*?)</answer>", completion)
        return 1.0 if found and found.group(1).strip() == example["label"] else 0.0

    def short(prompts, completions, label, **kwargs):
        # batch style: the label column as a list
        return [0.5 if len(c) < 40 and lab is not None else None for c, lab in zip(completions, label)]
""")
PROMPT = "<|im_start|>user\\nWhat is {n}+{n}?<|im_end|>\\n<|im_start|>assistant\\n"
# (response, label) -> (correct, short): correct falls back to -1.0 on a crash and on a hang (timeout_s 2)
CASES = [("<answer>4</answer><|im_end|>", "4", 1.0, 0.5), ("<answer>5</answer><|im_end|>", "4", 0.0, 0.5),
         ("no answer at all, and a long one besides this<|im_end|>", "6", 0.0, None),
         ("crash<|im_end|>", "8", -1.0, 0.5), ("hang<|im_end|>", "10", -1.0, 0.5)]


def _config(tmp_path, base_image):
    (tmp_path / "rewards.py").write_text(REWARDS)
    config = tmp_path / "rewardbox.yaml"
    config.write_text(json.dumps({
        "sandbox": {"backend": "docker", "docker": {"base_image": base_image}},
        "rewards": [{"name": "correct", "source": "rewards.py", "default_score": -1.0, "retries": 0, "timeout_s": 2},
                    {"name": "short", "source": "rewards.py", "style": "batch", "weight": 2.0}]}))
    return config


def _rollouts() -> list:
    out = []
    for i, (response, label, _, _) in enumerate(CASES):
        prompt = PROMPT.format(n=i)
        out.append((prompt + response, prompt, label))
    return out


def _expected(answers: list) -> None:
    for answer, (_, _, correct, short) in zip(answers, CASES):
        total = correct + (2.0 * short if short is not None else 0.0)
        assert answer["rewards"] == [total] and answer["scores"] == [total], answer
        logs = answer["extra_logs"]
        assert logs["correct"] == [correct] and logs["correct_fallback"] == [1.0 if correct == -1.0 else 0.0]
        assert (logs["short"] == [short]) if short is not None else logs["short"][0] != logs["short"][0]  # NaN
        assert logs["short_fallback"] == [0.0]


def _containers(docker_client) -> set:
    return {c.id for c in docker_client.containers.list(filters={"label": "rewardbox"}, ignore_removed=True)}


def test_openrlhf_scores_through_rewardbox_serve_openrlhf(tmp_path, docker_client, base_image):
    config = _config(tmp_path, base_image)
    before = _containers(docker_client)
    service = subprocess.Popen([sys.executable, "-m", "rewardbox.cli", "serve", str(config), "--openrlhf",
                                "127.0.0.1:0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    try:
        url = None
        deadline = time.monotonic() + 600
        seen = []
        assert service.stdout is not None
        while url is None and time.monotonic() < deadline:
            line = service.stdout.readline()
            assert line, "rewardbox serve ended before it served: " + "".join(seen)[-3000:]
            seen.append(line)
            found = re.search(r"(http://127\.0\.0\.1:\d+/get_reward)", line)
            url = found.group(1) if found else None
        assert url, "".join(seen)[-3000:]
        executor = load_agent().SingleTurnAgentExecutor(url)

        answers = asyncio.run(fetch_all(executor, _rollouts(), "http"))
        _expected(answers)

        # A whole rollout as OpenRLHF makes it (generate, decode, fetch the reward), into the Experience it trains on
        generator = load_samples_generator().SamplesGenerator.__new__(load_samples_generator().SamplesGenerator)
        prompt = PROMPT.format(n=2)
        output = asyncio.run(rollout(executor, prompt, "4", "<answer>4</answer>"))
        experience = generator._process_response_into_experience(output, max_len=4096)
        assert experience.rewards.flatten().tolist() == [2.0] and experience.scores.flatten().tolist() == [2.0]
        assert experience.info["correct"].flatten().tolist() == [1.0]
        assert experience.info["short_fallback"].flatten().tolist() == [0.0]

        # 1,000 rollouts at once, one request each, as OpenRLHF sends them: scored in a few batches per reward
        many = [(PROMPT.format(n=i) + f"<answer>{2 * i}</answer>", PROMPT.format(n=i), str(2 * i) if i % 3 else "wrong")
                for i in range(1000)]

        async def burst():
            first = await _stats(url)
            got = await fetch_all(executor, many, "http")
            return first, got, await _stats(url)

        stats_before, got, after = asyncio.run(burst())
        assert [a["extra_logs"]["correct"] for a in got] == [[1.0 if i % 3 else 0.0] for i in range(1000)]
        assert after["requests"] - stats_before["requests"] == 1000
        assert after["rollouts"] - stats_before["rollouts"] == 1000
        batches = after["batches"] - stats_before["batches"]
        assert 1 <= batches <= 50, batches  # not 1,000 sandbox calls per reward

        service.send_signal(signal.SIGTERM)
        rest, _ = service.communicate(timeout=120)
        assert service.returncode == 0, rest[-3000:]
        assert "stopped; all sandboxes were removed" in rest
    finally:
        if service.poll() is None:
            service.kill()
            service.wait()
    assert _containers(docker_client) <= before  # its sandboxes are gone


async def _stats(url: str) -> dict:
    async with aiohttp.ClientSession() as session:
        async with session.get(url.replace("/get_reward", "/stats")) as response:
            return await response.json()


def test_openrlhf_loads_the_one_line_reward_func_file_and_gets_the_same_values(tmp_path, docker_client, base_image):
    config = _config(tmp_path, base_image)
    reward_file = tmp_path / "reward_func.py"
    reward_file.write_text("from rewardbox.integrations.openrlhf import reward_func\n")
    rollouts = tmp_path / "rollouts.json"
    rollouts.write_text(json.dumps(_rollouts()))
    before = _containers(docker_client)
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "openrlhf" / "openrlhf_agent.py"), str(reward_file),
                           str(rollouts)], capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "REWARDBOX_CONFIG": str(config), "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-4000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("ANSWERS "))
    _expected(json.loads(line[len("ANSWERS "):]))
    assert _containers(docker_client) <= before  # stopped when OpenRLHF's process exited


def test_the_file_route_without_a_config_says_where_to_name_it(tmp_path):
    from rewardbox.integrations import openrlhf

    env = os.environ.pop(openrlhf.CONFIG_ENV, None)
    try:
        try:
            openrlhf.reward_func(["q"], [""], [None])
        except ValueError as e:
            assert "REWARDBOX_CONFIG=/path/to/rewardbox.yaml" in str(e)
        else:
            raise AssertionError("reward_func ran without a config")
    finally:
        if env is not None:
            os.environ[openrlhf.CONFIG_ENV] = env

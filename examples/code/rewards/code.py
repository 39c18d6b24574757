"""Code-execution rewards: the program in the completion's last fenced code block is run on the problem's tests
with ``rewardbox.sandbox.run_tests`` (under a uid of its own, with limits, without network). ``example["tests"]``
arrives as a JSON string: ``[{"stdin": ..., "stdout": ...}, ...]``."""

import ast
import json
import re

from rewardbox.sandbox import run_tests

CODE_BLOCK = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)  # ```python ... ``` or ``` ... ```


def pass_rate(prompt, completion, example):
    """The fraction of the tests the program passes; 0.0 without a code block."""
    blocks = CODE_BLOCK.findall(completion)
    if not blocks:
        return 0.0
    tests = json.loads(example["tests"])
    return run_tests(blocks[-1], tests, language=example.get("language", "python"), timeout_s=2).fraction


def code_format(prompt, completion, example):
    """1.0 for exactly one code block that parses as Python, 0.5 for code that does not parse (or several blocks),
    0.0 for none."""
    blocks = CODE_BLOCK.findall(completion)
    if len(blocks) != 1:
        return 0.5 if blocks else 0.0
    try:
        ast.parse(blocks[0])
    except (SyntaxError, ValueError):  # ValueError: a null byte in the source
        return 0.5
    return 1.0

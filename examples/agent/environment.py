"""A code agent's environment: the model runs Python with `run_python`, submits a program with `submit`, and
`get_reward` is the fraction of the problem's hidden tests the submitted program passes.

rewardbox runs each episode (reset, the tool calls, get_reward) in a sandbox process of its own; the programs the
model writes run under `rewardbox.sandbox.run_tests`/`run` inside it (a uid of their own, limits, no network). The
host never imports this file: it reads the class's methods (names, docstrings, type hints) from its text."""

import json

from rewardbox.sandbox import run, run_tests


class CodeEnv:
    """A programming problem with hidden stdin/stdout tests."""

    def reset(self, **kwargs) -> str:
        self.tests = json.loads(kwargs["tests"])  # the dataset's `tests` column (a JSON string)
        self.passed = 0.0
        return "Use run_python to try code, then submit your program."

    def run_python(self, code: str, stdin: str = "") -> str:
        """Runs a Python program and returns what it printed.

        Args:
            code: the program
            stdin: what the program reads from standard input
        """
        result = run(code, stdin=stdin, timeout_s=5)
        return (result.stdout + result.stderr)[-2000:] or f"(no output; {result.status})"

    def submit(self, code: str) -> str:
        """Submits a program: it is run on the problem's hidden tests.

        Args:
            code: the program
        """
        result = run_tests(code, self.tests, timeout_s=5)
        self.passed = result.passed / max(1, result.total)
        return f"{result.passed} of {result.total} hidden tests passed"

    def get_reward(self) -> float:
        return self.passed

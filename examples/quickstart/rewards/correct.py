"""1.0 when the answer equals the reference, compared symbolically with sympy (a package the trainer does not
need: it is installed in this reward's sandbox image only). ``example["answer"]`` arrives as a string."""

import re

import sympy

ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def correctness_reward(prompt, completion, example, trainer_state=None):
    match = ANSWER.search(completion)
    candidate = match.group(1) if match else (re.findall(r"-?\d+", completion) or [None])[-1]
    if candidate is None:
        return 0.0
    try:
        same = sympy.simplify(sympy.sympify(candidate.strip()) - sympy.sympify(example["answer"])) == 0
    except (sympy.SympifyError, TypeError, SyntaxError):
        return 0.0
    # a curriculum: an answer in the right format counts fully, a bare number half, later in training
    if match is None and trainer_state is not None and trainer_state.max_steps:
        return 0.5 if same and trainer_state.global_step < trainer_state.max_steps // 2 else 0.0
    return 1.0 if same else 0.0


# sympy fills caches as it works, and under isolation: sample every sample starts from this module's state after
# import: warmed here, once, they are every sample's (about a quarter of the cost of a sample scored cold).
for _answer, _reference in (("12", "12"), ("13", "12"), ("7 + 0", "7"), ("2*3", "6"), ("2*4", "6"), ("x + 1", "1"),
                            ("x + 2", "5"), ("1/2", "0.5"), ("-3", "3"), ("2.5", "5/2"), ("x*y", "2")):
    correctness_reward("", f"<answer>{_answer}</answer>", {"answer": _reference})

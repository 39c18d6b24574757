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

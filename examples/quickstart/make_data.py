"""Writes data/train.jsonl: small arithmetic word problems with their answers (deterministic)."""

import json
import random
from pathlib import Path

TEMPLATES = [
    ("Tom has {a} apples and buys {b} more. How many apples does Tom have?", lambda a, b: a + b),
    ("Sara has {a} pens and gives away {b}. How many pens does she have left?", lambda a, b: a - b),
    ("A box holds {a} rows of {b} eggs. How many eggs are in the box?", lambda a, b: a * b),
    ("What is {a} + {b}?", lambda a, b: a + b),
    ("What is {a} * {b}?", lambda a, b: a * b),
]


def main(n: int = 256, seed: int = 0) -> None:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        template, solve = TEMPLATES[i % len(TEMPLATES)]
        a, b = rng.randint(2, 12), rng.randint(1, 9)
        a, b = max(a, b), min(a, b)
        rows.append({"question": template.format(a=a, b=b), "answer": solve(a, b), "operands": [a, b]})
    path = Path(__file__).parent / "data" / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} problems to {path}")


if __name__ == "__main__":
    main()

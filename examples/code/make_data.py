"""Writes data/train.jsonl: short stdin/stdout programming problems, three tests each (deterministic).

Every problem carries a reference solution, and every reference is run on its tests with
``rewardbox.sandbox.run_tests`` (in plain Python: a helper process, no sandbox) before anything is written: a
problem whose tests its own reference fails stops the script."""

import json
import sys
from pathlib import Path

from rewardbox.sandbox import run_tests

INSTRUCTIONS = ("Write a Python program that reads its input from standard input and prints the answer to standard "
                "output. Answer with the whole program in one ```python fenced code block.")

# (statement, reference solution, [(stdin, expected stdout), ...])
PROBLEMS = [
    ("Read two integers a and b on one line, separated by a space. Print a + b.",
     "a, b = map(int, input().split())\nprint(a + b)",
     [("1 2", "3"), ("-5 5", "0"), ("1000000 2345", "1002345")]),
    ("Read one line of text. Print it reversed.",
     "print(input()[::-1])",
     [("hello", "olleh"), ("abc def", "fed cba"), ("x", "x")]),
    ("Read one line of text. Print how many vowels (a, e, i, o, u, upper or lower case) it contains.",
     "print(sum(c in 'aeiouAEIOU' for c in input()))",
     [("hello world", "3"), ("rhythm", "0"), ("AEIOU aeiou", "10")]),
    ("Read an integer n. For i from 1 to n print one line: FizzBuzz if i is divisible by 15, Fizz if by 3, Buzz if "
     "by 5, else i.",
     "for i in range(1, int(input()) + 1):\n"
     "    print('FizzBuzz' if i % 15 == 0 else 'Fizz' if i % 3 == 0 else 'Buzz' if i % 5 == 0 else i)",
     [("5", "1\n2\nFizz\n4\nBuzz"), ("1", "1"),
      ("15", "1\n2\nFizz\n4\nBuzz\nFizz\n7\n8\nFizz\nBuzz\n11\nFizz\n13\n14\nFizzBuzz")]),
    ("Read a line of integers separated by spaces. Print the largest.",
     "print(max(map(int, input().split())))",
     [("3 9 2", "9"), ("-4 -2 -7", "-2"), ("42", "42")]),
    ("Read a line of integers separated by spaces. Print the smallest.",
     "print(min(map(int, input().split())))",
     [("3 9 2", "2"), ("-4 -2 -7", "-7"), ("42", "42")]),
    ("Read an integer n (0 <= n <= 20). Print n! (n factorial).",
     "import math\nprint(math.factorial(int(input())))",
     [("0", "1"), ("5", "120"), ("20", "2432902008176640000")]),
    ("Read two positive integers a and b on one line. Print their greatest common divisor.",
     "import math\na, b = map(int, input().split())\nprint(math.gcd(a, b))",
     [("12 18", "6"), ("7 13", "1"), ("100 75", "25")]),
    ("Read two positive integers a and b on one line. Print their least common multiple.",
     "import math\na, b = map(int, input().split())\nprint(a * b // math.gcd(a, b))",
     [("4 6", "12"), ("7 3", "21"), ("10 10", "10")]),
    ("Read one word. Print yes if it reads the same forwards and backwards, else no.",
     "s = input().strip()\nprint('yes' if s == s[::-1] else 'no')",
     [("racecar", "yes"), ("hello", "no"), ("abba", "yes")]),
    ("Read a line of integers separated by spaces. Print them sorted in ascending order, separated by spaces.",
     "print(*sorted(map(int, input().split())))",
     [("3 1 2", "1 2 3"), ("5 -1 5 0", "-1 0 5 5"), ("7", "7")]),
    ("Read an integer n (0 <= n <= 90). Print the n-th Fibonacci number, where F(0) = 0 and F(1) = 1.",
     "a, b = 0, 1\nfor _ in range(int(input())):\n    a, b = b, a + b\nprint(a)",
     [("0", "0"), ("10", "55"), ("90", "2880067194370816120")]),
    ("Read one line of text. Print how many words it has (words are separated by whitespace).",
     "print(len(input().split()))",
     [("the quick brown fox", "4"), ("one", "1"), ("  spaced   out  words ", "3")]),
    ("Read one line of text. Print it in upper case.",
     "print(input().upper())",
     [("hello", "HELLO"), ("MiXeD case 123", "MIXED CASE 123"), ("a", "A")]),
    ("Read a non-negative integer n. Print the sum of its decimal digits.",
     "print(sum(int(d) for d in input().strip()))",
     [("0", "0"), ("1234", "10"), ("99999", "45")]),
    ("Read an integer n (n >= 1). Print yes if n is a prime number, else no.",
     "n = int(input())\nprint('yes' if n > 1 and all(n % d for d in range(2, int(n ** 0.5) + 1)) else 'no')",
     [("2", "yes"), ("1", "no"), ("91", "no")]),
    ("Read an integer n. Print even if it is even, else odd.",
     "print('even' if int(input()) % 2 == 0 else 'odd')",
     [("4", "even"), ("7", "odd"), ("-3", "odd")]),
    ("Read an integer n (n >= 1). Print the sum 1 + 2 + ... + n.",
     "n = int(input())\nprint(n * (n + 1) // 2)",
     [("1", "1"), ("10", "55"), ("1000", "500500")]),
    ("Read one line of words separated by single spaces. Print the words in reverse order, separated by single "
     "spaces.",
     "print(*input().split()[::-1])",
     [("hello world", "world hello"), ("a b c d", "d c b a"), ("single", "single")]),
    ("Read a non-negative integer n. Print n in binary, without leading zeros (0 is printed as 0).",
     "print(bin(int(input()))[2:])",
     [("5", "101"), ("0", "0"), ("255", "11111111")]),
    ("Read a line of integers separated by spaces. Print how many distinct values it contains.",
     "print(len(set(input().split())))",
     [("1 2 2 3", "3"), ("5 5 5", "1"), ("1 2 3 4 5", "5")]),
    ("Read a year. Print yes if it is a leap year in the Gregorian calendar, else no.",
     "y = int(input())\nprint('yes' if y % 4 == 0 and (y % 100 != 0 or y % 400 == 0) else 'no')",
     [("2024", "yes"), ("1900", "no"), ("2000", "yes")]),
    ("Read two integers a and b on one line. Print |a - b|, the absolute value of their difference.",
     "a, b = map(int, input().split())\nprint(abs(a - b))",
     [("3 10", "7"), ("10 3", "7"), ("-4 4", "8")]),
    ("Read a line of integers separated by spaces. Print their sum.",
     "print(sum(map(int, input().split())))",
     [("1 2 3", "6"), ("-1 1", "0"), ("100", "100")]),
]


def main() -> None:
    rows = []
    for statement, reference, tests in PROBLEMS:
        tests = [{"stdin": stdin, "stdout": stdout} for stdin, stdout in tests]
        result = run_tests(reference, tests, language="python", timeout_s=5)
        if result.passed != result.total:
            failed = [t for t, r in zip(tests, result.results) if not r.passed]
            sys.exit(f"the reference solution of {statement!r} fails {failed} ({result.status}): fix the problem")
        example = f"For example, for the input\n{tests[0]['stdin']}\nthe output is\n{tests[0]['stdout']}"
        rows.append({"question": f"{statement}\n\n{example}\n\n{INSTRUCTIONS}", "tests": json.dumps(tests),
                     "language": "python"})
    path = Path(__file__).parent / "data" / "train.jsonl"
    path.parent.mkdir(exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {len(rows)} problems, each reference passing its {len(tests)} tests, to {path}")


if __name__ == "__main__":
    main()

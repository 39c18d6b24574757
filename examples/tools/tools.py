"""A tool the model calls: the host reads its signature and docstring from this file (never imports it), and each
call runs in a sandbox, in a process of its own."""


def add(a: int, b: int) -> int:
    """Adds two numbers.

    Args:
        a: the first number
        b: the second number
    """
    if a > 9 or b > 9:
        raise ValueError("add takes one-digit numbers")  # the model is shown {"error": "..."}
    return a + b

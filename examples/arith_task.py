"""The toy RL tasks the trainer examples use, generated from a seed (the same questions, in the same order,
for every run that passes the same seed).

- `add1` (the default, both trainer examples): "What is a + b?" with one-digit a, b; reward 1 when the
  completion contains the sum. A 135M instruct model answers some correctly at the start and learns to
  answer more within minutes, so reward curves separate a learning run from a broken one -- and every
  config saturates (issue 44).
- Harder levels that do not saturate in a short run (issue 44), scored strictly (the last number in the
  completion is the answer): `add2c` two two-digit numbers whose sum carries, `add3c` two three-digit numbers
  with at least one carry, `mul21` a two-digit number times a one-digit number (> 1).
"""

from __future__ import annotations

import random
import re

QUESTION = "What is {a} {op} {b}? Answer with the number only."
LEVELS = ("add1", "add2c", "add3c", "mul21")
STRICT = frozenset({"add2c", "add3c", "mul21"})  # scored by the last number, not by containment


def _carries(a: int, b: int) -> bool:
    while a or b:
        if a % 10 + b % 10 >= 10:
            return True
        a, b = a // 10, b // 10
    return False


def _pair(rng: random.Random, level: str) -> tuple[int, str, int, int]:
    if level == "add1":
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        return a, "+", b, a + b
    if level == "mul21":
        a, b = rng.randint(10, 99), rng.randint(2, 9)
        return a, "*", b, a * b
    lo, hi = (10, 99) if level == "add2c" else (100, 999)
    while True:  # at least one carry: the step a model gets wrong first
        a, b = rng.randint(lo, hi), rng.randint(lo, hi)
        if _carries(a, b):
            return a, "+", b, a + b


def questions(n: int, seed: int, level: str = "add1") -> list[dict]:
    """n questions: {"question": str, "answer": str}, seeded."""
    if level not in LEVELS:
        raise ValueError(f"unknown task level {level!r}: one of {', '.join(LEVELS)}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, op, b, answer = _pair(rng, level)
        out.append({"question": QUESTION.format(a=a, op=op, b=b), "answer": str(answer)})
    return out


def last_number(completion: str) -> str | None:
    """The last integer in a completion (thousands separators dropped), or None."""
    found = re.findall(r"-?\d[\d,]*", completion)
    return found[-1].replace(",", "") if found else None


def score(completion: str, answer: str, level: str = "add1") -> float:
    """1.0 when the completion answers right, else 0.0 (rule-based, no model): `add1` contains the sum, the
    harder levels end with it (their last number)."""
    if level in STRICT:
        return 1.0 if last_number(completion) == answer else 0.0
    return 1.0 if answer in completion else 0.0

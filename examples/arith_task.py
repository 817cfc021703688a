"""The toy RL task both trainer examples use: "What is a + b?" (one-digit a, b), reward 1 when the
completion contains the sum. A 135M instruct model answers some correctly at the start and learns
to answer more within minutes, so reward curves separate a learning run from a broken one."""

from __future__ import annotations

import random

QUESTION = "What is {a} + {b}? Answer with the number only."


def questions(n: int, seed: int) -> list[dict]:
    """n questions: {"question": str, "answer": str}, seeded."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        out.append({"question": QUESTION.format(a=a, b=b), "answer": str(a + b)})
    return out


def score(completion: str, answer: str) -> float:
    """1.0 when the completion contains the right sum, else 0.0 (rule-based, no model)."""
    return 1.0 if answer in completion else 0.0

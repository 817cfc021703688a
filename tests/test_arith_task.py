"""The trainer examples' task levels (examples/arith_task.py): seeded and held out, the harder levels as
described (carries, products), scored strictly by the last number; verl's reward function reads the level
from the dataset row."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from conftest import REPO

sys.path.insert(0, str(REPO / "examples"))
import arith_task  # noqa: E402


def _reward():
    spec = importlib.util.spec_from_file_location("arith_reward", REPO / "examples" / "verl" / "arith_reward.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.compute_score


def test_levels_are_seeded_and_as_described():
    for level in arith_task.LEVELS:
        qs = arith_task.questions(200, 7, level)
        assert qs == arith_task.questions(200, 7, level) != arith_task.questions(200, 8, level)
        for q in qs:
            a, op, b = q["question"].removeprefix("What is ").split("?")[0].split()
            a, b = int(a), int(b)
            assert q["answer"] == str(a + b if op == "+" else a * b)
            if level == "add1":
                assert 1 <= a <= 9 and 1 <= b <= 9
            elif level == "mul21":
                assert 10 <= a <= 99 and 2 <= b <= 9 and op == "*"
            else:
                digits = 2 if level == "add2c" else 3
                assert len(str(a)) == len(str(b)) == digits and arith_task._carries(a, b)
    with pytest.raises(ValueError, match="unknown task level"):
        arith_task.questions(1, 0, "add9")


def test_harder_levels_are_scored_by_the_last_number():
    assert arith_task.score("57 or 58", "57") == 1.0  # add1: containment (the trainer examples' reward)
    assert arith_task.score("57 or 58", "57", "add2c") == 0.0  # listing candidates earns nothing
    assert arith_task.score("The answer is 1,458.", "1458", "add3c") == 1.0
    assert arith_task.score("1458 is wrong, it is 1459", "1458", "add3c") == 0.0
    assert arith_task.score("no number", "1458", "add3c") == 0.0
    score = _reward()
    assert score("flashrl_arith", "57 or 58", "57", {"level": "add2c"}) == 0.0
    assert score("flashrl_arith", "57 or 58", "57", {"split": "train", "index": 0}) == 1.0  # older datasets

"""verl reward function for examples/arith_task.py (`custom_reward_function.path=` this file).

verl loads this file by path (not as a package), hence the sys.path line."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from arith_task import score  # noqa: E402


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return score(solution_str, ground_truth, (extra_info or {}).get("level") or "add1")

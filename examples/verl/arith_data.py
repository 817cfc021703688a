"""Write examples/arith_task.py's questions as verl's parquet datasets (the columns verl's RL dataset
reads: data_source, prompt as chat messages, ability, reward_model.ground_truth, extra_info with the task
level, which arith_reward.py scores by). The test split is held out: another seed.

    python examples/verl/arith_data.py OUT_DIR [--train N] [--test N] [--seed S] [--level add1|add2c|add3c|mul21]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from arith_task import questions  # noqa: E402

DATA_SOURCE = "flashrl_arith"


def rows(n: int, seed: int, split: str, level: str = "add1") -> list[dict]:
    return [{"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": q["question"]}], "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": q["answer"]},
             "extra_info": {"split": split, "index": i, "level": level}}
            for i, q in enumerate(questions(n, seed, level))]


def write(out: Path, train: int, test: int, seed: int, level: str = "add1") -> tuple[Path, Path]:
    import pandas as pd

    out.mkdir(parents=True, exist_ok=True)
    paths = out / "train.parquet", out / "test.parquet"
    for path, n, s, split in ((paths[0], train, seed, "train"), (paths[1], test, seed + 1, "test")):
        tmp = path.with_suffix(".tmp")
        pd.DataFrame(rows(n, s, split, level)).to_parquet(tmp)
        tmp.replace(path)
    return paths


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--train", type=int, default=20000)
    ap.add_argument("--test", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--level", default="add1", help="examples/arith_task.py LEVELS")
    a = ap.parse_args()
    print(*write(a.out, a.train, a.test, a.seed, a.level))

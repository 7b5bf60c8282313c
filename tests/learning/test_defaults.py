"""Defaults that learn: the fastest task of bench/zoo.py's suite, through the whole stack (`kuberl up`),
with nothing configured but the algorithm and the env id, so every other key is at its default
(services/algorithms/<name>/config.py) and the default is what is tested. Target and window are the suite's
(bench/zoo.py TASKS); the budget is rl-baselines3-zoo's step budget for the task, which SB3 with the
zoo's tuned hyper-parameters needs 6,600 steps of (docs/benchmarks.md). Assertions are on returns and env
steps only, never on wall time.
"""

from __future__ import annotations

import pytest

from bench.zoo import TASKS
from tests.helpers import up_to_target


@pytest.mark.learning
@pytest.mark.timeout(900)
def test_sac_defaults_solve_pendulum_within_the_zoo_budget(tmp_path):
    task = TASKS["pendulum-sac"]
    cfg = {"algorithm": task.algo, "env": {"id": task.env_id}}
    summary = up_to_target(tmp_path, task.name, cfg, target=task.target, budget=20_000, window=task.window)
    assert summary["samples_lost"]["total"] == 0

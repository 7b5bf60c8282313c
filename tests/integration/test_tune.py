"""`kuberl tune` (services/cli/tune.py): an Optuna study whose trials are whole `kuberl up` runs.

Four trials, two at once, the first four values enqueued so that each path is taken: two that learn
(complete), one whose env cannot be made (its run fails: recorded as failed, the study goes on) and
one with a learning rate too small to learn, which the median pruner stops against a completed trial.
The failing trial is second, so the last starts only when a trial has completed (both slots are held
by learning trials until then): with two completions needed, a loaded machine once let it run its
whole budget before the second learner finished, and it was not pruned. The best config is written and loads; the study is in its SQLite storage, and running the
command again adds a trial to it.
"""

from __future__ import annotations

import optuna
import pytest

from services.cli.main import main as kuberl
from services.cli.tune import run_study
from services.config import load_config
from tests.helpers import write_config

BUDGET = 12_000


def study_config(tmp_path):
    return write_config(tmp_path / "tune.yaml", {
        "algorithm": "ppo",
        "env": {"id": "CartPole-v1", "num_envs": 4},
        "ppo": {"rollout_steps": 64, "batch_steps": 256, "num_epochs": 4, "num_minibatches": 4,
                "hidden_sizes": [64, 64]},
        "topology": {"actors": 1},
        "planner": {"enabled": False},
        "learner": {"checkpoint_interval_s": 3600},
        "evaluation": {"after_training": False},
        "run": {"target_return": None, "max_env_steps": BUDGET, "return_window": 20, "poll_interval_s": 0.25,
                "run_dir": str(tmp_path / "runs")},
        "tune": {"study": "cartpole", "trials": 4, "parallel": 2, "prune_after_trials": 1,
                 "prune_after_steps": 4000, "report_every_steps": 2000, "seed": 0,
                 "space": {"ppo.learning_rate": {"type": "float", "low": 1e-6, "high": 3e-3, "log": True},
                           "env.id": {"type": "categorical", "choices": ["CartPole-v1", "NoSuchEnv-v0"]}}},
    })


def test_a_study_completes_prunes_records_a_failure_and_writes_the_best_config(tmp_path, capsys):
    config = study_config(tmp_path)
    summary = run_study(config, enqueue=[
        {"ppo.learning_rate": 2.5e-3, "env.id": "CartPole-v1"},
        {"ppo.learning_rate": 1e-3, "env.id": "NoSuchEnv-v0"},
        {"ppo.learning_rate": 1e-3, "env.id": "CartPole-v1"},
        {"ppo.learning_rate": 1e-6, "env.id": "CartPole-v1"},
    ])
    states = {t["number"]: t["state"] for t in summary["trials"]}
    assert states == {0: "complete", 1: "failed", 2: "complete", 3: "pruned"}, summary["trials"]
    rows = {t["number"]: t for t in summary["trials"]}
    assert "NoSuchEnv-v0" in rows[1]["error"]
    assert rows[3]["env_steps"] < BUDGET, "the pruned trial was stopped before its budget"
    values = [rows[n]["value"] for n in (0, 2)]
    best = summary["best"]
    assert best["number"] in (0, 2) and best["value"] == max(values) >= min(values)
    cfg = load_config(best["config"])       # the best trial's whole config, loadable as it is
    assert cfg.section("ppo").learning_rate == best["params"]["ppo.learning_rate"] and cfg.env.id == "CartPole-v1"
    assert cfg.run.max_env_steps == BUDGET
    out = capsys.readouterr().out
    assert "trial 3: pruned at" in out and "trial 1: failed" in out and "best: trial" in out

    study = optuna.load_study(study_name="cartpole", storage=summary["storage"])
    S = optuna.trial.TrialState
    assert [t.state for t in study.trials] == [S.COMPLETE, S.FAIL, S.COMPLETE, S.PRUNED]
    assert study.trials[3].intermediate_values   # the running returns reported to the pruner

    # Run again: one more trial, sampled (TPE), in the same study.
    assert kuberl(["tune", str(config), "--trials", "1", "--parallel", "1"]) in (0, 1)
    assert len(optuna.load_study(study_name="cartpole", storage=summary["storage"]).trials) == 5


@pytest.mark.parametrize("space, message", [
    ({"ppo.no_such_key": {"low": 0.1, "high": 0.2}}, "tune.space.ppo.no_such_key: is not a setting"),
    ({"ppo.hidden_sizes": {"type": "categorical", "choices": [1, 2]}}, "is not a single setting"),
    ({}, "tune.space: is empty"),
])
def test_a_space_that_names_no_setting_is_refused_naming_it(tmp_path, capsys, space, message):
    config = write_config(tmp_path / "c.yaml", {"tune": {"space": space}, "run": {"run_dir": str(tmp_path)}})
    assert kuberl(["tune", str(config)]) == 2
    assert message in capsys.readouterr().err

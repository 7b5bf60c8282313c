"""CartPole-v1 through the whole stack (`kuberl up`: separate processes, gRPC between them).

PPO, with what `make run` trains (configs/cartpole_ppo.yaml), must reach CartPole-v1's own reward
threshold, a mean return of 475 over the last 100 episodes, within 300k env steps, on each of three
seeds. DQN must reach 195 within 300k: 475 over 100 episodes is not a stable outcome of DQN on
CartPole for anyone measured here. In docs/benchmarks.md's suite, at the zoo's 50k-step budget SB3
with the zoo's tuned settings held a mean of 178.9, kuberl's defaults 270.7 and its tuned 131.2, and
none reached 475. Assertions are on returns and env steps only, never on wall time.
"""

from __future__ import annotations

import csv

import pytest
import yaml

from tests.helpers import ROOT, up_to_target

TARGET = 195.0
BUDGETS = {"cartpole_dqn": 300_000}   # PPO: the 475 test below


@pytest.mark.learning
@pytest.mark.timeout(900)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_make_runs_ppo_reaches_475_within_300k_steps_on_three_seeds(tmp_path, seed):
    cfg = yaml.safe_load((ROOT / "configs" / "cartpole_ppo.yaml").read_text())
    summary = up_to_target(tmp_path, "cartpole_ppo", {**cfg, "seed": seed}, target=475.0, budget=300_000)
    assert summary["samples_lost"]["total"] == 0


@pytest.mark.learning
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", sorted(BUDGETS))
def test_cartpole_reaches_195_within_the_step_budget(tmp_path, name):
    cfg = yaml.safe_load((ROOT / "configs" / f"{name}.yaml").read_text())
    summary = up_to_target(tmp_path, name, cfg, target=TARGET, budget=BUDGETS[name])
    # The run directory holds what the issue promises.
    run = tmp_path / "run"
    for item in ("config.yaml", "metrics.csv", "summary.json", "logs/buffer-0.log", "logs/learner-0.log",
                 "logs/actor-0.log"):
        assert (run / item).exists(), item
    assert list((run / "checkpoints").glob("ckpt-*.pt")) and list((run / "tb").glob("events.out.tfevents.*"))
    assert len((run / "metrics.csv").read_text().splitlines()) > 2
    # episodes.csv: one row per episode read, in the order read; the last 100 give the summary's mean.
    with open(run / "episodes.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == summary["episodes_read"] >= 100
    assert [float(r["env_steps"]) for r in rows] == sorted(float(r["env_steps"]) for r in rows)
    assert all(int(r["length"]) >= 1 and float(r["return"]) == int(r["length"]) for r in rows)  # CartPole: +1 a step
    last = [float(r["return"]) for r in rows[-100:]]
    assert sum(last) / 100 == pytest.approx(summary["mean_return"])


@pytest.mark.learning
@pytest.mark.timeout(900)
def test_ppo_learns_through_forced_staleness_with_its_stale_fragments_corrected(tmp_path):
    """Weights reach the actor only every 4th update, so fragments fall up to 5 versions behind
    the learner; with a max lag of 1 they are trained on through V-trace targets and truncated importance
    weights (ppo.stale_fragments: correct). PPO still reaches 475, and a large share of what it
    trained on was corrected (measured: 61 of 114 fragments, reaching 475 at 58k env steps): the
    correction is what it learned through, not a path it rarely took."""
    cfg = yaml.safe_load((ROOT / "configs" / "cartpole_ppo.yaml").read_text())
    cfg = {**cfg, "learner": {**cfg["learner"], "publish_interval_updates": 4},
           "ppo": {**cfg["ppo"], "max_policy_lag": 1, "stale_fragments": "correct"}}
    summary = up_to_target(tmp_path, "cartpole_ppo_stale", cfg, target=475.0, budget=300_000)
    learner = summary["last_stats"]["learner-0"]
    fragments = learner["learner/samples_total"] / (cfg["ppo"]["rollout_steps"] * cfg["env"]["num_envs"])
    corrected = learner["learner/fragments_corrected_total"]
    assert corrected >= 0.25 * fragments, (corrected, fragments)
    assert learner["learner/fragments_dropped_stale_total"] == 0 and summary["samples_lost"]["total"] == 0

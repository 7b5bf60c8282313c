"""Several agents per env, trained through the whole stack (`kuberl up`: separate processes, gRPC between
them). Assertions are on returns, win rates and env steps (agent steps recorded), never on wall time.

- **Cooperative: simple_spread** (mpe2, 3 agents, 25 steps, one shared policy), configs/simple_spread_ppo.yaml:
  a mean per-agent return of -21 or better over the last 100 agent episodes within 1,500,000 agent
  steps. A uniform random policy scores -27.1 (600 agent episodes, sd 7.9). Measured on the development
  machine (2 cores): seed 0 -22.8 at 600k; seed 1 crossed -21 at about 500k and was at -17.5 at 1.5M.
- **Cooperative with two policies: simple_spread**, configs/simple_spread_two_policies_ppo.yaml: `lead`
  plays agent_0 and `team` the two others, each with its own learner, weights and buffer table; for
  1,000,000 agent steps, then each policy's mean return over its agents' last 200 episodes must be -25.0
  or better (random: -27.1), and `kuberl up`'s evaluation must have played both final checkpoints
  together (60 agent episodes, deterministic). Measured (2 cores, 2026-11-27), last 100 episodes at
  500k: seed 0 lead -22.8, team -22.1; seed 1 lead -23.2, team -23.1; at 1M / 1.5M steps: seed 0
  lead -23.0 / -21.8, team -23.0 / -21.6; seed 1 lead -21.9 /
  -22.1, team -22.1 / -22.0 (the shared policy above learns faster: each of these policies sees only
  its agents' samples); the greedy evaluation of seed 0's final checkpoints over 300 agent episodes
  -23.2 (lead) and -23.1 (team). A clean-clone run on 2026-11-27 learned slower (seed 0: -25.0 at
  250k, -24.0 at 475k, and over the last 200 episodes at 500k lead -24.5, team -25.3), so the test
  runs to 1M steps and asks for -25.0, 2.1 above random (a run of it then: lead -22.6, team -22.3).
- **Competitive, by self-play: tron** (kuberl_envs.tron, 8x8), configs/tron_selfplay_ppo.yaml (PPO with
  an entropy bonus of 0.01; a quarter of the opponents' moves at random, selfplay.opponent_epsilon; a
  fifth of the games not against the newest weights against kuberl_envs.tron:roomy, a fixed player
  unlike the policy, selfplay.fixed_players), for 1,500,000 steps; then the final checkpoint plays 400
  games against a uniform random player (deterministic actions) and 400 against the scripted player
  (kuberl_envs/tron.py: straight on until blocked, then to a free side; it wins 89% against random,
  loses 0.5%, and draws every game against itself), with sampled actions (it is deterministic and
  only the start varies, so a deterministic policy would play the same dozen games over and over).
  Asserted: at least 90% wins and at most 2% losses against random; against the scripted player a
  score of 0.6 or more (a win 1, a draw 1/2) and at least twice as many wins as losses; the Elo
  against the pool above its start. Measured on the development machine (2 cores, 2026-11-29, two
  runs side by side, seeds 4-7), wins/losses/draws of 400: against random 389/3/8, 397/0/3, 388/0/12,
  394/1/5; against the scripted player 292/23/85, 273/44/83, 300/23/77, 379/3/18 (scores 0.79-0.97).
  Before the fixed player (opponent_epsilon 0.1, 2026-11-27, seeds 0-4) the scores against the
  scripted player were 0.62-0.76, and a clean-clone run of this test won only 68/87/245 (0.45), so
  it was not asserted; with the fixed player and opponent_epsilon 0.1 (seeds 0-3) 0.77-0.94, but
  only 91.75-94.75% wins against random (docs/multi-agent.md, "Measured").
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from tests.helpers import ROOT, run_logs, up_to_target

pytest.importorskip("mpe2", reason="mpe2 is in the mpe extra (and dev)")

TRON_BUDGET = 1_500_000


@pytest.mark.learning
@pytest.mark.timeout(900)
def test_a_shared_policy_learns_simple_spread(tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "simple_spread_ppo.yaml").read_text())
    summary = up_to_target(tmp_path, "simple_spread_ppo", cfg, target=-21.0, budget=1_500_000)
    assert summary["samples_lost"]["total"] == 0


@pytest.mark.learning
@pytest.mark.timeout(900)
def test_two_policies_learn_simple_spread_side_by_side(tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "simple_spread_two_policies_ppo.yaml").read_text())
    cfg["run"] = {"max_env_steps": 1_000_000, "return_window": 200, "poll_interval_s": 0.5}
    cfg["evaluation"] = {"episodes": 60, "num_envs": 10, "max_seconds": 0}
    _, summary = _up_to_budget(tmp_path, cfg, timeout=880)
    assert summary["samples_lost"]["total"] == 0, summary
    for name in ("lead", "team"):
        policy = summary["policies"][name]
        assert policy["return_window"] == 200 and policy["mean_return"] >= -25.0, summary["policies"]
        evaluated = summary["evaluation"]["policies"][name]   # (both policies' final checkpoints, together)
        assert evaluated["episodes"] >= 20 and evaluated["return"]["mean"] is not None, summary["evaluation"]["policies"]


def _up_to_budget(tmp_path, cfg: dict, timeout: float):
    """`kuberl up` on `cfg` until its run.max_env_steps, every process exiting cleanly: (run dir, summary)."""
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(path), "--run-dir", str(tmp_path),
                           "--name", "run", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["reason"] == "max_env_steps" and summary["env_steps"] >= cfg["run"]["max_env_steps"], summary
    failed = {n: code for n, code in summary["exit_codes"].items() if code != 0}
    assert not failed, f"processes that did not exit cleanly: {failed}\n{run_logs(run, failed)}"
    return run, summary


def _eval_against(run, against: str, games: int, *more: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "services.cli.main", "eval", str(run), "--against", against,
                          "--episodes", str(games), "--json", *more], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.learning
@pytest.mark.timeout(1800)
def test_self_play_beats_random_and_the_scripted_player_at_tron(tmp_path):
    cfg = yaml.safe_load((ROOT / "configs" / "tron_selfplay_ppo.yaml").read_text())
    cfg["run"] = {**cfg["run"], "max_env_steps": TRON_BUDGET, "poll_interval_s": 0.5}
    run, summary = _up_to_budget(tmp_path, cfg, timeout=1400)
    random = _eval_against(run, "random", 400)
    assert random["win_rate"] >= 0.9 and random["losses"] <= 8, random
    # The scripted player (sampled actions: against it, a deterministic policy plays the same dozen games).
    scripted = _eval_against(run, "kuberl_envs.tron:scripted", 400, "--stochastic")
    score = (scripted["wins"] + scripted["draws"] / 2) / scripted["games"]
    assert score >= 0.6 and scripted["wins"] >= 2 * scripted["losses"], scripted
    # `kuberl up`'s own evaluation of a self-play run: games against random, not the policy against itself.
    evaluation = summary["evaluation"]
    # (10 games: the 400 above won 94-99% and lost under 1%, so 6 wins and at most 1 loss leave room)
    assert evaluation["against"] == "random" and evaluation["games"] == 10, evaluation
    assert evaluation["wins"] >= 6 and evaluation["losses"] <= 1, evaluation
    # The games self-play scored: the rating against the pool rose from its start.
    rows = (run / "metrics.csv").read_text().splitlines()
    header, last = rows[0].split(","), rows[-1].split(",")
    assert float(last[header.index("selfplay_elo")]) > 1000.0

"""After training: `kuberl eval` on a CartPole policy trained in the test, and `kuberl up`'s evaluation
of its final checkpoint in summary.json (docs/after-training.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from services.cli import evaluate
from tests.helpers import ROOT, TINY_PPO, eval_cli, video_frames, write_config
from tests.policies import train

# PPO on CartPole-v1, 40k env steps in-process (~8 s on 2 cores). Its greedy return was 447..500 over
# seeds 0..4 on the development machine (the stochastic policy's training return is far lower); the bar
# is the classic "solved" level of CartPole, well below that.
TRAIN_STEPS = 40_000
GREEDY_BAR = 195.0
CARTPOLE = {"seed": 0, "env": {"id": "CartPole-v1", "num_envs": 8}, "ppo": {"rollout_steps": 32, "batch_steps": 256}}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("cartpole") / "run"
    train(run, CARTPOLE, TRAIN_STEPS)
    return run


def test_greedy_eval_clears_the_bar_and_prints_well_formed_json(run_dir):
    out = eval_cli(str(run_dir), "--json", "--episodes", "7", "--num-envs", "3")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # stdout is the JSON object and nothing else
    assert result["deterministic"] is True and result["algorithm"] == "ppo" and result["env_id"] == "CartPole-v1"
    assert result["episodes"] == 7 == len(result["returns"]) == len(result["lengths"])
    assert result["checkpoint"].endswith(".pt") and result["policy_version"] > 0
    returns = np.array(result["returns"])
    assert result["return"] == pytest.approx({"mean": returns.mean(), "std": returns.std(),
                                              "min": returns.min(), "max": returns.max()})
    assert result["returns"] == [float(n) for n in result["lengths"]]  # CartPole: +1 per step
    assert result["return"]["mean"] >= GREEDY_BAR, result


def test_text_output_and_a_video_with_one_frame_per_step(run_dir, tmp_path):
    video = tmp_path / "cartpole.mp4"
    done = eval_cli(str(run_dir), "--episodes", "2", "--video", str(video), "--video-episodes", "2")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "evaluating ckpt-" in out and "deterministic actions" in out
    assert "return  mean" in out and "length  mean" in out
    assert f"video: {video}: 2 episodes" in out
    frames = int(out.split(" frames at ")[0].rsplit(" ", 1)[1])
    assert video_frames(video) == (frames, (400, 600, 3))  # CartPole's rgb_array frame, one per step
    # An episode of L steps gives L frames; this policy balances for CartPole-v1's 500-step limit.
    assert frames > 2 * GREEDY_BAR


def test_stochastic_eval_acts_as_the_actors_do(run_dir, capsys):
    assert evaluate.main([str(run_dir), "--episodes", "2", "--stochastic", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["deterministic"] is False and result["episodes"] == 2


def test_up_evaluates_its_final_checkpoint_into_the_summary(tmp_path):
    config = write_config(tmp_path / "c.yaml", {**TINY_PPO, "planner": {"enabled": False},
                                                "run": {"target_return": None, "max_env_steps": 2000,
                                                        "poll_interval_s": 0.2},
                                                "evaluation": {"episodes": 3, "num_envs": 2, "max_seconds": 0}})
    out = subprocess.run([sys.executable, "-m", "services.cli.main", "up", str(config), "--run-dir", str(tmp_path),
                          "--name", "run", "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reason"] == "max_env_steps"
    evaluation = summary["evaluation"]
    assert evaluation["episodes"] == 3 and evaluation["deterministic"] is True, evaluation
    assert evaluation["policy_version"] >= summary["policy_version"]  # the shutdown checkpoint, after the last poll
    assert evaluation["checkpoint"].startswith(str(tmp_path / "run" / "checkpoints"))
    assert set(evaluation["return"]) == {"mean", "std", "min", "max"}
    assert "evaluating the final checkpoint: 3 episodes" in out.stdout and "return  mean" in out.stdout

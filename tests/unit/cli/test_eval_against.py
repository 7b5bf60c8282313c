"""`kuberl eval --against`: a policy plays games of a two-player PettingZoo env against a named
opponent, each side in turn, and the wins, losses and draws are counted as self-play counts them.

On kuberl_envs.tron the cycles start facing each other on different rows, so a cycle that always goes
straight on hits the far wall: two of them crash at the same step (a draw, every game), and the
scripted player, which turns before a wall, outlives it (a loss, every game)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from services.cli import evaluate
from services.config import config_from_dict
from tests.helpers import TINY_PPO
from tests.policies import untrained

TRON = {"algorithm": "ppo", "env": {"id": "pettingzoo:kuberl_envs.tron", "kwargs": {"size": 6}},
        "ppo": {"hidden_sizes": [16]}}


def straight_on(obs: np.ndarray) -> int:
    return 0


def always_straight(algo) -> None:
    """The policy picks action 0 (straight on) in every state: its action head's weights zeroed, a large bias."""
    for name, p in algo.net.named_parameters():
        if p.shape[0] == 3 and name.endswith("weight"):
            torch.nn.init.zeros_(p)
        if p.shape == (3,) and name.endswith("bias"):
            with torch.no_grad():
                p.copy_(torch.tensor([50.0, 0.0, 0.0]))


def test_games_against_a_named_opponent_are_scored_each_side_in_turn(tmp_path, capsys):
    untrained(tmp_path / "run", TRON, edit=always_straight)
    for against, outcome in ((f"{__name__}:straight_on", "draws"), ("kuberl_envs.tron:scripted", "losses")):
        assert evaluate.main([str(tmp_path / "run"), "--against", against, "--episodes", "6", "--json"]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result[outcome] == result["games"] == 6, result
        assert result["win_rate"] == 0.0 and result["against"] == against
    assert evaluate.main([str(tmp_path / "run"), "--against", "random", "--episodes", "20", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["wins"] + result["losses"] + result["draws"] == 20


def test_against_is_refused_naming_what_is_wrong(tmp_path, capsys):
    untrained(tmp_path / "run", TRON)
    assert evaluate.main([str(tmp_path / "run"), "--against", "no_such_module:f"]) == 2
    assert "--against no_such_module:f: No module named 'no_such_module'" in capsys.readouterr().err
    untrained(tmp_path / "cartpole", {"algorithm": "ppo", "env": {"id": "CartPole-v1"}, "ppo": {"hidden_sizes": [16]}})
    assert evaluate.main([str(tmp_path / "cartpole"), "--against", "random"]) == 2
    assert "--against plays agents against each other: env.id 'CartPole-v1' has one agent" in capsys.readouterr().err


def test_up_evaluates_a_self_play_run_against_random(tmp_path, monkeypatch):
    """A self-play run's policy against itself scores 0 whatever it learned: `kuberl up`'s evaluation
    plays games against a uniform random player instead, and says so."""
    cfg = config_from_dict({**TINY_PPO, "env": {"id": "pettingzoo:kuberl_envs.tron", "num_envs": 2,
                                                "kwargs": {"size": 6}}, "selfplay": {"enabled": True},
                            "evaluation": {"episodes": 6}})
    calls = []
    monkeypatch.setattr("services.cli.trained.load_trained", lambda run_dir, seed: "trained")
    monkeypatch.setattr(evaluate, "play_against", lambda trained, against, games, seed: calls.append(
        (trained, against, games)) or {"against": against, "games": games, "wins": 4, "losses": 1, "draws": 1,
                                      "win_rate": 4 / 6})
    result = evaluate.evaluate_after_training(cfg, tmp_path / "run")
    assert calls == [("trained", "random", 6)] and result["win_rate"] == pytest.approx(4 / 6)
    assert evaluate.describe(result) == "against random: 4 wins, 1 losses, 1 draws of 6 games (win rate 0.667)"

"""`kuberl eval --against`: a policy plays games of a two-player PettingZoo env against a named
opponent, each side in turn, and the wins, losses and draws are counted as self-play counts them.
Without --against, such an env's evaluation prints the deterministic and the sampled result.

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


def test_the_random_opponent_is_self_plays_random_player():
    """`--against random` plays the random player of self-play (spaces.random_actions) in the policy's
    action layout: uniform over what the mask allows (a MultiDiscrete's mask flat, as the env reports it),
    a Box uniform within its bounds, seeded; an unbounded Box has no uniform player and is refused."""
    from services.common.protocol.spaces import Box, Discrete, MultiDiscrete

    def one(player, mask):   # one agent's move: the player acts on a batch of one
        return player.act(np.zeros((1, 1)), None if mask is None else np.asarray(mask, bool)[None], 0)[0][0]

    pick = evaluate.opponent("random", Discrete(4), seed=3)
    drawn = [int(one(pick, [0, 1, 0, 1])) for _ in range(400)]
    assert set(drawn) == {1, 3} and 150 < drawn.count(1) < 250
    assert [int(one(pick, None)) for _ in range(200)].count(0) > 20
    again = evaluate.opponent("random", Discrete(4), seed=3)
    assert [int(one(again, [0, 1, 0, 1])) for _ in range(400)] == drawn
    multi = evaluate.opponent("random", MultiDiscrete((2, 3)), seed=0)
    rows = np.array([one(multi, [0, 1, 1, 0, 1]) for _ in range(200)])
    assert rows.shape == (200, 2) and set(rows[:, 0]) == {1} and set(rows[:, 1]) == {0, 2}
    box = evaluate.opponent("random", Box.of((2,), [-1, 0], [1, 5]), seed=0)
    points = np.array([one(box, None) for _ in range(200)])
    assert points.shape == (200, 2) and (points >= [-1, 0]).all() and (points <= [1, 5]).all()
    with pytest.raises(evaluate.EvalError, match="--against random: the action space is a Box without finite bounds"):
        evaluate.opponent("random", Box.of((1,), [-np.inf], [np.inf]), seed=0)


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


def test_roomy_keeps_out_of_the_opponents_reach_and_beats_random():
    """kuberl_envs.tron:roomy, the fixed player for self-play's pool: of its free moves, one the opponent's
    head cannot also reach next, then the most room; where `scripted` goes straight on, into that reach."""
    from kuberl_envs.tron import Tron, roomy, scripted

    env = Tron(6)
    env.reset(seed=0)
    env.walls[:] = False
    env.heads, env.headings = [np.array([3, 1]), np.array([2, 2])], [1, 3]   # p0 faces right, p1 beside its path
    obs = env.observe("p0")
    # straight (3, 2) and left (2, 1) are next to p1's head (2, 2); right (4, 1) is not
    assert scripted(obs) == 0 and roomy(obs) == 2
    env.heads[1] = np.array([0, 5])   # far away: the most room, straight on between equals
    env.walls[4:, :3] = True          # below-left is walled off: right has no room
    assert roomy(env.observe("p0")) in (0, 1)

    rng = np.random.default_rng(0)
    results = []
    for game in range(100):   # (seeded: the same 100 games every run)
        obs, _ = env.reset(seed=game)
        while True:
            obs, r, term, trunc, _ = env.step({"p0": roomy(obs["p0"]), "p1": int(rng.integers(3))})
            if term["p0"] or trunc["p0"]:
                results.append(r["p0"])
                break
    assert results.count(1.0) >= 95 and results.count(-1.0) <= 1, (results.count(1.0), results.count(-1.0))


def test_an_env_of_agents_is_evaluated_deterministic_and_sampled_by_default(tmp_path, capsys):
    """Where every agent plays the run's policy, a policy may rely on randomness its most likely action
    lacks: both results are printed unless --actions (or --stochastic) names one; a one-agent env gets
    the deterministic one unless --actions both."""
    run = str(tmp_path / "run")
    untrained(tmp_path / "run", TRON)   # (near-uniform logits: sampling plays other games)
    assert evaluate.main([run, "--episodes", "4", "--num-envs", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    sampled = result["stochastic"]
    assert result["deterministic"] is True and sampled["deterministic"] is False
    assert result["episodes"] == sampled["episodes"] == 4 and sampled["lengths"] != result["lengths"]
    assert evaluate.main([run, "--episodes", "4", "--num-envs", "2"]) == 0
    out = capsys.readouterr().out
    assert "deterministic and stochastic (sampled) actions, each evaluated" in out and out.count("return  mean") == 2
    assert out.index("deterministic actions (the most likely):") < out.index("stochastic actions (sampled, as the")
    for flags, deterministic in ((["--actions", "deterministic"], True), (["--stochastic"], False)):
        assert evaluate.main([run, "--episodes", "2", "--json", *flags]) == 0
        result = json.loads(capsys.readouterr().out)
        assert result["deterministic"] is deterministic and "stochastic" not in result, flags
    assert evaluate.main([run, "--against", "random", "--episodes", "2", "--json"]) == 0   # a win rate: one
    assert "stochastic" not in json.loads(capsys.readouterr().out)
    untrained(tmp_path / "cartpole", TINY_PPO)   # CartPole
    for flags, both in (([], False), (["--actions", "both"], True)):
        assert evaluate.main([str(tmp_path / "cartpole"), "--episodes", "2", "--json", *flags]) == 0
        assert ("stochastic" in json.loads(capsys.readouterr().out)) is both

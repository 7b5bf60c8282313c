"""Turn-based PettingZoo games as parallel envs (services/common/turns.py): only the player whose turn it
is chooses, the others pass under a mask of one action; rewards reach every player at the step they are
given; a player the game ends early leaves at that step (and is stepped with None, as AEC wants); a whole
game through ParallelVectorEnv and the rollout records every player's steps."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.agents import ParallelVectorEnv, make_parallel
from services.common.turns import TurnBased

pytest.importorskip("pettingzoo", reason="PettingZoo is in the actor extra")
TICTACTOE = "pettingzoo:pettingzoo.classic.tictactoe_v3"


def test_only_the_player_to_move_chooses_and_the_win_reaches_both_at_the_last_move():
    env = make_parallel(TICTACTOE)()
    obs, _ = env.reset(seed=0)
    assert env.action_space("player_1").n == 10 and env.observation_space("player_1")["action_mask"].shape == (10,)
    moves = [0, 3, 1, 4, 2]   # X takes the top row; O answers at 3 and 4
    for k, square in enumerate(moves):
        mover, other = ("player_1", "player_2") if k % 2 == 0 else ("player_2", "player_1")
        assert obs[mover]["action_mask"][9] == 0 and obs[mover]["action_mask"][square] == 1
        assert list(obs[other]["action_mask"]) == [0] * 9 + [1]   # off its turn: pass only
        obs, rewards, terminated, truncated, _ = env.step({mover: square, other: 9})
        if k < len(moves) - 1:
            assert rewards == {"player_1": 0.0, "player_2": 0.0} and not any(terminated.values())
    assert rewards == {"player_1": 1.0, "player_2": -1.0}
    assert terminated == {"player_1": True, "player_2": True} and env.agents == []
    # The board each player saw last: its own marks first, then the other's, then whether it is to move.
    assert obs["player_1"]["observation"][0, :, 0].tolist() == [1, 1, 1]
    assert obs["player_2"]["observation"][0, :, 1].tolist() == [1, 1, 1]
    assert env.observation_space("player_1")["observation"].shape == (3, 3, 3)


def test_each_player_sees_whether_it_is_to_move():
    """The same board off one's turn and on it differ by the to-move flag (a last value of a flat
    observation; a last channel of an image)."""
    env = make_parallel(TICTACTOE)()
    obs, _ = env.reset(seed=0)
    assert (obs["player_1"]["observation"][:, :, 2] == 1).all() and (obs["player_2"]["observation"][:, :, 2] == 0).all()
    obs, *_ = env.step({"player_1": 4, "player_2": 9})
    assert (obs["player_1"]["observation"][:, :, 2] == 0).all() and (obs["player_2"]["observation"][:, :, 2] == 1).all()
    flat = TurnBased(Elimination(), "pettingzoo:elimination")
    assert flat.observation_space("a")["observation"].shape == (2,)
    obs, _ = flat.reset()
    assert obs["a"]["observation"].tolist() == [0.0, 1.0] and obs["b"]["observation"].tolist() == [0.0, 0.0]


def test_passing_on_its_turn_is_refused_naming_the_player():
    env = make_parallel(TICTACTOE)()
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"agent 'player_1' passed \(or gave action 9\) on its turn"):
        env.step({"player_1": 9, "player_2": 9})


class Elimination:
    """A toy AEC game of three players taking turns (a, b, c, a, ...): c is out after its first move
    (reward -1), a and b play on until each has moved 3 times; a move of 1 scores 1."""

    metadata = {"name": "elimination_v0", "is_parallelizable": False}

    def __init__(self):
        from gymnasium import spaces

        self.possible_agents = ["a", "b", "c"]
        self._obs, self._act = spaces.Box(0.0, 9.0, (1,), np.float32), spaces.Discrete(2)

    def observation_space(self, agent):
        return self._obs

    def action_space(self, agent):
        return self._act

    def reset(self, seed=None, options=None):
        self.agents = list(self.possible_agents)
        self.moves = dict.fromkeys(self.agents, 0)
        self.rewards = dict.fromkeys(self.agents, 0.0)
        self.terminations = dict.fromkeys(self.agents, False)
        self.truncations = dict.fromkeys(self.agents, False)
        self.agent_selection = "a"
        self.stepped_dead = []

    def observe(self, agent):
        return np.array([self.moves[agent]], np.float32)

    def _next(self):
        order = self.possible_agents
        i = order.index(self.agent_selection)
        self.agent_selection = next(order[(i + k) % 3] for k in range(1, 4) if order[(i + k) % 3] in self.agents)

    def step(self, action):
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:   # AEC: a finished agent steps with None
            assert action is None
            self.stepped_dead.append(agent)
            self.agents.remove(agent)
            if self.agents:
                self._next()
            return
        self.rewards = dict.fromkeys(self.agents, 0.0)
        self.moves[agent] += 1
        self.rewards[agent] = float(action)
        if agent == "c":
            self.rewards["c"], self.terminations["c"] = -1.0, True
        if all(self.moves[x] >= 3 for x in ("a", "b")):
            self.terminations.update({x: True for x in self.agents})
        self._next()

    def close(self):
        pass


def test_a_player_out_early_leaves_at_that_step_and_the_others_play_on():
    env = TurnBased(Elimination(), "pettingzoo:elimination")
    obs, _ = env.reset()
    assert env.agents == ["a", "b", "c"]
    order, seen = [], []
    while env.agents:
        mover = next(a for a in env.agents if obs[a]["action_mask"][2] == 0)
        order.append(mover)
        obs, rewards, terminated, _, _ = env.step({a: 1 if a == mover else 2 for a in env.agents})
        seen.append((dict(rewards), dict(terminated), list(env.agents)))
    assert order == ["a", "b", "c", "a", "b", "a", "b"]
    assert seen[2] == ({"a": 0.0, "b": 0.0, "c": -1.0}, {"a": False, "b": False, "c": True}, ["a", "b"])
    assert env.aec.stepped_dead == ["c"]           # stepped with None when its turn came round
    assert seen[-1][1] == {"a": True, "b": True} and seen[-1][2] == []


def test_a_turn_based_game_runs_as_a_vector_env_of_slots():
    envs = ParallelVectorEnv(make_parallel(TICTACTOE), 2, TICTACTOE)
    obs, info = envs.reset(seed=0)
    assert obs.shape == (4, 3, 3, 3) and info["action_mask"].shape == (4, 10)   # (the to-move flag's channel)
    rng = np.random.default_rng(0)
    games = 0
    for _ in range(60):
        mask = info["action_mask"].astype(bool)
        actions = np.array([rng.choice(np.flatnonzero(m)) for m in mask])
        obs, rewards, terminated, truncated, info = envs.step(actions)
        games += int(info["episode_over"].sum())
        # A game ends with +1/-1 or 0/0 between its two players.
        for k in np.flatnonzero(info["episode_over"]):
            assert rewards[2 * k] + rewards[2 * k + 1] == 0.0
    assert games >= 6
    envs.close()


def test_self_play_of_a_turn_based_game_records_the_learning_players_every_step_under_its_mask():
    """Tic-tac-toe self-play through the actor's rollout: every copy's learning player is recorded at
    every step, its passes included (each under a mask of pass alone), and every game is scored."""
    from services.actor.rollout import Rollout
    from services.common.protocol.fragments import RawFragment, decode_fragment
    from services.common.stats import Metrics
    from services.config import config_from_dict
    from tests.helpers import TINY_PPO
    from tests.unit.actor.test_selfplay import collect_versions

    copies = 4
    cfg = config_from_dict({**TINY_PPO, "env": {"id": TICTACTOE, "num_envs": copies},
                            "selfplay": {"enabled": True, "snapshot_every": 1, "pool_size": 2}})
    rollout = Rollout(cfg, "ttt", 0, Metrics("actor"))
    try:
        frags = collect_versions(rollout, 3)
        decoded = [decode_fragment(RawFragment(m.payload)) for m in frags]
    finally:
        rollout.close()
    steps = 3 * TINY_PPO["ppo"]["rollout_steps"]
    assert sum(f.num_samples for f in decoded) == steps * copies
    masks = np.concatenate([f.action_mask.reshape(-1, 10) for f in decoded])
    actions = np.concatenate([f.actions.reshape(-1) for f in decoded])
    assert masks[np.arange(len(actions)), actions].all()                # every action within its mask
    passing = masks[:, 9]
    assert passing.any() and (~passing).any() and not masks[passing, :9].any()   # off turn: pass alone
    c = rollout.metrics.counters
    assert c["actor/selfplay_games_total"] == c["actor/selfplay_wins_total"] + c["actor/selfplay_losses_total"] \
        + c["actor/selfplay_draws_total"] > 0

"""Turn-based PettingZoo games (AEC envs that cannot step in parallel: tic-tac-toe, connect four, chess)
as parallel envs, so that the actors step them as they step every env of several agents.

At each step every agent still in the game acts, but only the one whose turn it is chooses: each agent's
action space gets one more action, *pass* (the last, n for a game of n actions), and its action mask
allows only the game's legal moves on its turn and only pass off its turn. The agents' transitions are
then one per step, all of them recorded, and a reward reaches an agent at the step it is given (a win
at the opponent's losing move, for instance), with the step's observation. The passes cost samples, not
learning: under a mask of one action the policy's choice has probability 1 (nothing to learn), while
its value sees the whole game. Agents that the game ends early (a player out of a game of more) leave
at that step; AEC's rule that a finished agent be stepped with None is kept here.

Each player's observation also says whether it is that player's turn (one more channel of an image
observation, [H, W, C + 1], else one more value of the flattened observation: 1 on its turn, else 0).
The game's own observation is meant for the player to move; off its turn the same board can mean the
other is to move, and whose move it is decides the board's value. A game's observation may be
PettingZoo's classic dict of `observation` and `action_mask`, or a plain Box (every move then legal on
its turn). Only Discrete action spaces take turns this way.
"""

from __future__ import annotations

from typing import Any

import numpy as np


class TurnBased:
    """PettingZoo's ParallelEnv API over the turn-based AEC env `aec` (module docstring)."""

    def __init__(self, aec: Any, env_id: str = "the env"):
        from gymnasium import spaces

        self.aec = aec
        self.metadata = {**getattr(aec, "metadata", {}), "turn_based": True}
        self.possible_agents = list(aec.possible_agents)
        self.agents: list[str] = []
        self.moves: dict[str, int] = {}   # each agent's number of game actions (pass is that index)
        self._spaces: dict[str, tuple[Any, Any]] = {}
        for agent in self.possible_agents:
            action = aec.action_space(agent)
            if not isinstance(action, spaces.Discrete):
                raise ValueError(f"env.id: {env_id!r} is turn-based, and agent {agent!r} acts in {action}: turn-based "
                                 f"games take Discrete actions (a pass is added to each agent's)")
            n = self.moves[agent] = int(action.n)
            obs = aec.observation_space(agent)
            if isinstance(obs, spaces.Dict) and set(obs.spaces) == {"observation", "action_mask"}:
                obs = obs["observation"]
            if not isinstance(obs, spaces.Box):
                raise ValueError(f"env.id: {env_id!r} is turn-based, and agent {agent!r} observes {obs}: turn-based "
                                 f"games take Box observations (a to-move flag is added to each)")
            self._spaces[agent] = (spaces.Dict({"observation": _with_flag(obs),
                                                "action_mask": spaces.Box(0, 1, (n + 1,), np.int8)}),
                                   spaces.Discrete(n + 1))

    def observation_space(self, agent: str) -> Any:
        return self._spaces[agent][0]

    def action_space(self, agent: str) -> Any:
        return self._spaces[agent][1]

    def _observe(self, agent: str) -> dict[str, np.ndarray]:
        raw = self.aec.observe(agent)
        n = self.moves[agent]
        if isinstance(raw, dict) and "action_mask" in raw:
            obs, legal = raw["observation"], np.asarray(raw["action_mask"], np.int8)
        else:
            obs, legal = raw, np.ones(n, np.int8)
        mask = np.zeros(n + 1, np.int8)
        turn = agent == self.aec.agent_selection
        if turn:
            mask[:n] = legal
        else:
            mask[n] = 1
        return {"observation": _flagged(np.asarray(obs), turn), "action_mask": mask}

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        self.aec.reset(seed=seed, options=options)
        self.agents = list(self.aec.agents)
        return {a: self._observe(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict[str, Any], dict[str, float], dict[str, bool], dict[str, bool], dict[str, Any]]:
        mover, acting = self.aec.agent_selection, list(self.agents)
        move = int(actions[mover])
        if not 0 <= move < self.moves[mover]:
            raise ValueError(f"agent {mover!r} passed (or gave action {move}) on its turn: its action mask allows "
                             f"only the game's moves there")
        self.aec.step(move)
        rewards = {a: float(self.aec.rewards.get(a, 0.0)) for a in acting}
        terminated = {a: bool(self.aec.terminations.get(a, False)) for a in acting}
        truncated = {a: bool(self.aec.truncations.get(a, False)) for a in acting}
        self.agents = [a for a in acting if not (terminated[a] or truncated[a])]
        # The last observations of those whose game ended, before AEC lets them go.
        observations = {a: self._observe(a) for a in acting if a not in self.agents}

        def over(a: str) -> bool:
            return bool(self.aec.terminations.get(a, False) or self.aec.truncations.get(a, False))

        # AEC's rule: an agent whose game ended is stepped with None when it is selected, until a live
        # agent is (none, once the whole game is over: the parallel episode then ends here).
        while self.aec.agents and not all(over(a) for a in self.aec.agents) and over(self.aec.agent_selection):
            self.aec.step(None)
        observations.update({a: self._observe(a) for a in self.agents})   # (whose turn it is now)
        return observations, rewards, terminated, truncated, {a: {} for a in acting}

    def render(self) -> Any:
        return self.aec.render()

    def close(self) -> None:
        self.aec.close()


def _with_flag(space: Any) -> Any:
    """`space` with room for the to-move flag: one more channel of an image ([H, W, C] -> [H, W, C + 1]),
    else one more value of the flattened observation."""
    from gymnasium import spaces

    low, high = np.asarray(space.low, space.dtype), np.asarray(space.high, space.dtype)
    if len(space.shape) == 3:
        pad = [(0, 0), (0, 0), (0, 1)]
        return spaces.Box(np.pad(low, pad, constant_values=0), np.pad(high, pad, constant_values=1), dtype=space.dtype)
    flag = np.zeros(1, space.dtype)
    return spaces.Box(np.concatenate([low.reshape(-1), flag]), np.concatenate([high.reshape(-1), flag + 1]),
                      dtype=space.dtype)


def _flagged(obs: np.ndarray, turn: bool) -> np.ndarray:
    """`obs` with the to-move flag (1 on the player's turn), laid out as `_with_flag` says."""
    if obs.ndim == 3:
        return np.concatenate([obs, np.full((*obs.shape[:2], 1), int(turn), obs.dtype)], axis=2)
    return np.append(obs.reshape(-1), np.asarray(int(turn), obs.dtype))

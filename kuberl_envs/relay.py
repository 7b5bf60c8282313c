"""`relay`: a small PettingZoo parallel env whose agents come and go, to show (and test) how kuberl
records several agents per env (services/common/agents.py). Use it as `env.id: pettingzoo:kuberl_envs.relay`.

Three agents, one episode of `length` steps (default 7):
- `a` plays the whole episode;
- `b` plays from the start and terminates after its third step;
- `c` joins after the second step and leaves after the fifth without terminating (it is cut short).
Each agent sees [its index, the step, the episode number] and picks one of 3 actions; its reward is
100 * action + 10 * step + index, so every recorded step can be told apart. `log` keeps, per agent
life, what each step was: the reference a test compares fragments against.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv

AGENTS = ("a", "b", "c")


class Relay(ParallelEnv):
    metadata = {"name": "relay_v0"}

    def __init__(self, length: int = 7):
        self.length = length
        self.possible_agents = list(AGENTS)
        self.agents: list[str] = []
        self.t = self.episode = 0
        # Every step each agent took: (agent, episode, obs, action, reward, terminated, truncated, next obs).
        self.log: list[tuple[str, int, np.ndarray, int, float, bool, bool, np.ndarray]] = []

    def observation_space(self, agent: str) -> spaces.Box:
        return spaces.Box(-np.inf, np.inf, (3,), np.float32)

    def action_space(self, agent: str) -> spaces.Discrete:
        return spaces.Discrete(3)

    def _obs(self, agent: str) -> np.ndarray:
        return np.array([AGENTS.index(agent), self.t, self.episode], np.float32)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        self.t, self.episode = 0, self.episode + 1
        self.agents = ["a", "b"]
        return {a: self._obs(a) for a in self.agents}, {a: {} for a in self.agents}

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        if set(actions) != set(self.agents):
            raise ValueError(f"actions for {sorted(actions)}, agents {self.agents}")
        before = {a: self._obs(a) for a in self.agents}
        rewards = {a: float(100 * int(actions[a]) + 10 * self.t + AGENTS.index(a)) for a in self.agents}
        self.t += 1
        terminated = {a: a == "b" and self.t == 3 for a in self.agents}
        truncated = {a: self.t == self.length for a in self.agents}
        observations = {a: self._obs(a) for a in self.agents}
        gone = {a for a in self.agents if terminated[a] or truncated[a] or (a == "c" and self.t == 5)}
        for a in self.agents:
            self.log.append((a, self.episode, before[a], int(actions[a]), rewards[a], terminated[a],
                             truncated[a] or (a in gone and not terminated[a]), observations[a]))
        self.agents = [a for a in self.agents if a not in gone]
        if self.t == 2 and self.agents:
            self.agents.append("c")
            observations["c"] = self._obs("c")
        return observations, rewards, terminated, truncated, {a: {} for a in observations}


def parallel_env(**kwargs: Any) -> Relay:
    return Relay(**kwargs)

"""`tron`: two light cycles on a small grid, a competitive PettingZoo parallel env for self-play
(docs/multi-agent.md). Use it as `env.id: pettingzoo:kuberl_envs.tron`.

Both players move at once, one cell per step, and leave a wall behind them. A player that moves off
the grid, into any wall, or into the cell the other moves into, crashes. One crash: that player gets
-1 and the other +1; both at once: 0 each (a draw); the episode ends there (terminated), or after
`size * size` steps (truncated, a draw).

Actions are relative (Discrete 3: straight, turn left, turn right), so a player never reverses into
its own wall. Each player sees the grid from its own head, facing up: [2, 2 * size - 1, 2 * size - 1]
float32 flattened (walls, with the outside as wall; the other player's head), so one network plays
either side. `scripted` is the fixed opponent tests measure against; `roomy` another, for self-play's pool.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from gymnasium import spaces
from pettingzoo import ParallelEnv

AGENTS = ("p0", "p1")
# Headings as (row, col) steps: 0 up, 1 right, 2 down, 3 left. Turning left is -1, right +1.
STEPS = np.array([(-1, 0), (0, 1), (1, 0), (0, -1)])
TURN = (0, -1, 1)   # action -> heading change


class Tron(ParallelEnv):
    metadata = {"name": "tron_v0"}

    def __init__(self, size: int = 8):
        if size < 4:
            raise ValueError(f"size: {size} must be >= 4")
        self.size = size
        self.view = 2 * size - 1
        self.possible_agents = list(AGENTS)
        self.agents: list[str] = []
        self.rng = np.random.default_rng()

    def observation_space(self, agent: str) -> spaces.Box:
        return spaces.Box(0.0, 1.0, (2 * self.view * self.view,), np.float32)

    def action_space(self, agent: str) -> spaces.Discrete:
        return spaces.Discrete(3)

    def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[dict, dict]:
        if seed is not None:
            self.rng = np.random.default_rng(seed)
        n = self.size
        self.walls = np.zeros((n, n), bool)
        row = int(self.rng.integers(1, n - 1))
        # Facing each other from opposite sides (which side is whose, at random).
        heads = [np.array([row, 1]), np.array([n - 1 - row, n - 2])]
        headings = [1, 3]
        if self.rng.random() < 0.5:
            heads.reverse()
            headings.reverse()
        self.heads, self.headings = heads, headings
        for h in self.heads:
            self.walls[tuple(h)] = True
        self.t = 0
        self.agents = list(AGENTS)
        return {a: self.observe(a) for a in self.agents}, {a: {} for a in self.agents}

    def observe(self, agent: str) -> np.ndarray:
        """The grid around the agent's head, rotated so that it faces up."""
        i = AGENTS.index(agent)
        n, v, c = self.size, self.view, self.size - 1
        out = np.ones((2, v, v), np.float32)
        out[1] = 0.0
        (r, col), (orow, ocol) = self.heads[i], self.heads[1 - i]
        out[0, c - r:c - r + n, c - col:c - col + n] = self.walls
        out[1, c - r + orow, c - col + ocol] = 1.0
        return np.rot90(out, k=self.headings[i], axes=(1, 2)).reshape(-1).copy()

    def step(self, actions: dict[str, Any]) -> tuple[dict, dict, dict, dict, dict]:
        n = self.size
        moved = []
        for i, a in enumerate(AGENTS):
            self.headings[i] = (self.headings[i] + TURN[int(actions[a])]) % 4
            moved.append(self.heads[i] + STEPS[self.headings[i]])
        crashed = [not (0 <= h[0] < n and 0 <= h[1] < n) or bool(self.walls[tuple(h)]) for h in moved]
        if (moved[0] == moved[1]).all():
            crashed = [True, True]
        self.t += 1
        for i, h in enumerate(moved):
            self.heads[i] = h
            if not crashed[i]:
                self.walls[tuple(h)] = True
        if crashed[0] != crashed[1]:
            rewards = {a: -1.0 if crashed[i] else 1.0 for i, a in enumerate(AGENTS)}
        else:
            rewards = {a: 0.0 for a in AGENTS}
        over = any(crashed)
        truncated = not over and self.t >= n * n
        for i in range(2):   # (a crashed head is off the grid or on a wall: seen from there, clipped)
            self.heads[i] = np.clip(self.heads[i], 0, n - 1)
        observations = {a: self.observe(a) for a in AGENTS}
        done = over or truncated
        if done:
            self.agents = []
        return (observations, rewards, {a: over for a in AGENTS}, {a: truncated for a in AGENTS},
                {a: {} for a in AGENTS})


def scripted(obs: np.ndarray) -> int:
    """The fixed opponent: straight on while the cell ahead is free, else a free side (left first),
    else straight (a crash). It never looks further than one cell. (Any grid size: the view's side is
    read from the observation.)"""
    view = int(round((obs.size / 2) ** 0.5))
    walls = obs.reshape(2, view, view)[0]
    c = view // 2
    for action, (dr, dc) in ((0, (-1, 0)), (1, (0, -1)), (2, (0, 1))):
        if walls[c + dr, c + dc] < 0.5:
            return action
    return 0


def roomy(obs: np.ndarray) -> int:
    """A fixed player unlike `scripted`: of the free cells it can move to, one the opponent's head cannot
    also reach next (where there is one), with the most room behind it (the cells reachable from it,
    by flood fill), straight on between equals. Stronger than `scripted` against random (400 seeded
    games on 8x8: 397/0/3 against its 340/2/58); a player for self-play's pool
    (`selfplay.fixed_players`), not the one tests measure against."""
    view = int(round((obs.size / 2) ** 0.5))
    grid = obs.reshape(2, view, view)
    walls = grid[0] >= 0.5
    c = view // 2
    danger = {(int(r) + dr, int(col) + dc) for r, col in np.argwhere(grid[1] >= 0.5)
              for dr, dc in ((-1, 0), (1, 0), (0, -1), (0, 1))}
    best, best_key = 0, None
    for action, (dr, dc) in ((0, (-1, 0)), (1, (0, -1)), (2, (0, 1))):
        start = (c + dr, c + dc)
        if walls[start]:
            continue
        seen, todo = {start}, [start]
        while todo:
            r, col = todo.pop()
            for nr, nc in ((r - 1, col), (r + 1, col), (r, col - 1), (r, col + 1)):
                if 0 <= nr < view and 0 <= nc < view and not walls[nr, nc] and (nr, nc) not in seen:
                    seen.add((nr, nc))
                    todo.append((nr, nc))
        key = (start not in danger, len(seen))
        if best_key is None or key > best_key:
            best, best_key = action, key
    return best


def parallel_env(**kwargs: Any) -> Tron:
    return Tron(**kwargs)

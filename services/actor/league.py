"""A league: self-play with several policies (config `policies` with `selfplay`, docs/multi-agent.md "A league").

Each policy plays its own agents of every copy (its *side*: the agents `policies.<name>.agents` names) and
keeps a pool of its own snapshots (selfplay.py `Pool`: `snapshot_every`, `pool_size`, `keep`, its Elo
rating). At each episode of a copy:

- with probability `latest_probability` every side is played by its policy's newest weights and every
  side is recorded (each policy learns from its own agents, as a run of several policies without
  self-play does);
- else one policy, drawn uniformly, is the *learning* side (its newest weights, recorded), and every
  other side is played by an opponent drawn from that side's own pool as self-play draws one
  (`Pool.draw`: a fixed player with `fixed_probability`, the random player with `random_probability`,
  else one of its snapshots, uniform or prioritized; its newest weights while it has none of those, then
  recorded only with `record_latest`). `opponent_epsilon` makes that share of a snapshot's (or an
  unrecorded newest side's) moves random.

A side's score in a finished game is its agents' summed return against the other sides' (`game_score`
over the sides: a win above every other side, a loss below any). Games with a learning side move that
policy's Elo against each snapshot it met (rated as its policy was when taken), and its win rates against
the random and the fixed players; every policy's metrics are its own: the gauges under
actor/policies/<policy>/ (selfplay_elo, selfplay_win_rate, selfplay_random_win_rate, selfplay_pool_size)
and the counters actor/policies/<policy>/selfplay_{games,wins,losses,draws}_total. Games where every side
was the newest weights are counted for every policy, and rated for none. `swap_sides` does not apply:
the sides are the policies' agents.
"""

from __future__ import annotations

import numpy as np

from services.actor.seats import Learning, Seats
from services.actor.selfplay import LATEST, Opponent, Pool, seat_actions
from services.common.agents import game_score
from services.common.stats import Metrics
from services.config import ExperimentConfig

EVERY_SIDE = "*"   # a copy's episode in which every side is its policy's newest weights, all recorded


class League:
    """The sides of every copy (`learner`: each copy's learning policy, or EVERY_SIDE), each policy's pool,
    and each group's seats (`seats`, by policy name) for the rollout."""

    def __init__(self, cfg: ExperimentConfig, sides: dict[str, tuple[Learning, int]], copies: int, metrics: Metrics,
                 rng: np.random.Generator):
        """`sides`: each policy's training player and its agents per copy (its group's slots: agent j of
        copy k in slot k * agents + j), in the env's group order."""
        self.cfg, self.sp, self.rng, self.copies = cfg, cfg.selfplay, rng, copies
        self.names = list(sides)
        self.agents = {name: agents for name, (_, agents) in sides.items()}
        self.pools = {name: Pool(cfg, learning, copies * agents, metrics.scoped(name), rng, name=name)
                      for name, (learning, agents) in sides.items()}
        self.learner: list[str] = [EVERY_SIDE] * copies
        self.opponent: dict[str, list[Opponent]] = {name: [LATEST] * copies for name in sides}
        self.recorded = {name: np.zeros(copies * a, bool) for name, a in self.agents.items()}
        self.live = {name: np.zeros(copies * a, bool) for name, a in self.agents.items()}   # its newest weights play
        self.returns = {name: np.zeros(copies * a) for name, a in self.agents.items()}
        self.seats = {name: Side(self, name) for name in sides}
        self._stepped: set[str] = set()
        for k in range(copies):
            self.new_episode(k)

    def new_episode(self, k: int) -> None:
        """Draw copy k's learning side and the other sides' opponents for the episode it starts."""
        learner = EVERY_SIDE
        if self.rng.random() >= self.sp.latest_probability:
            learner = self.names[int(self.rng.integers(len(self.names)))]
        self.learner[k] = learner
        for name in self.names:
            opponent = LATEST if learner in (EVERY_SIDE, name) else self.pools[name].draw(latest=False)
            self.opponent[name][k] = opponent
            slots = slice(k * self.agents[name], (k + 1) * self.agents[name])
            self.live[name][slots] = opponent is LATEST
            self.recorded[name][slots] = learner in (EVERY_SIDE, name) or (opponent is LATEST and self.sp.record_latest)

    def stepped(self, name: str, rewards: np.ndarray, ended: np.ndarray, over: np.ndarray | None) -> None:
        """Side `name`'s step is done; once every side's is, score the copies whose game ended (`over`)
        and draw their next episode."""
        self.returns[name] += rewards
        self.pools[name].learning.ended(ended)
        self.pools[name].ended(ended)
        self._stepped.add(name)
        if len(self._stepped) < len(self.names):
            return
        self._stepped.clear()
        for k in np.flatnonzero(over) if over is not None else ():
            sides = np.array([self.returns[n][k * self.agents[n]:(k + 1) * self.agents[n]].sum() for n in self.names])
            learner = self.learner[k]
            for i, n in enumerate(self.names):
                if learner in (EVERY_SIDE, n):
                    pool, score = self.pools[n], game_score(sides, i)
                    pool.counted(score)
                    if learner == n:   # rated against each opponent side it met
                        for other in self.names:
                            if other != n:
                                self.opponent[other][k].scored(pool, score)
                self.returns[n][k * self.agents[n]:(k + 1) * self.agents[n]] = 0.0
            self.new_episode(k)


class Side(Seats):
    """One policy's group of slots in a league: its newest weights where its side is live, the opponent
    drawn for its side elsewhere."""

    def __init__(self, league: League, name: str):
        super().__init__(league.pools[name].learning)
        self.league, self.name, self.pool = league, name, league.pools[name]

    def recorded(self, present: np.ndarray | None) -> np.ndarray:
        mine = self.league.recorded[self.name]
        return mine if present is None else present & mine

    def act(self, obs: np.ndarray, present: np.ndarray | None, mask: np.ndarray | None, env_steps: int
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        league = self.league
        return seat_actions(self.learning, obs, present, mask, env_steps, league.live[self.name],
                            league.opponent[self.name], league.agents[self.name], self.pool.random,
                            league.sp.opponent_epsilon, league.rng)

    def stepped(self, rewards: np.ndarray, ended: np.ndarray, over: np.ndarray | None) -> None:
        self.league.stepped(self.name, rewards, ended, over)

    def swapped(self) -> None:
        self.pool.swapped()



"""Self-play in the actor (config `selfplay`, docs/multi-agent.md "Self-play").

In each env copy of a PettingZoo env (services/common/agents.py) one agent, the *learning* agent, is
played by the policy that trains, and only its steps are recorded; the copy's other agents are
played by an *opponent*: the newest weights, or a frozen snapshot of the policy from a pool this actor
keeps. Nothing of it reaches the buffer or the learner: they see one agent per copy, as they would a
single-agent env.

- **The pool.** Of the policy versions this actor swaps in, every `snapshot_every`-th becomes a
  snapshot (its weights copied into a network of its own). `keep: newest`: the pool holds the newest
  `pool_size`. `keep: history`: it holds the newest `pool_size - pool_size // 2`, and `pool_size // 2`
  older ones drawn uniformly from all that left the newest (reservoir sampling: the n-th to leave
  replaces a uniformly drawn one of them with probability (pool_size // 2) / n), so the policy keeps
  meeting the play it learned to beat long ago.
- **The draw, at each episode of a copy:** the learning agent is uniform over `possible_agents`
  (`swap_sides`; else always the first); the opponent is the newest weights with probability
  `latest_probability` (always while the pool is empty), else a snapshot from the pool:
  `sampling: uniform`, each alike; `sampling: prioritized` (prioritized fictitious self-play, as
  AlphaStar's league), snapshot i with probability proportional to (1 - s_i)^2, where
  s_i = (points + 1) / (games + 2) is the learning policy's mean score against it so far (a win 1, a
  draw 1/2), so the opponents it still loses to are met most. With `random_probability` r, the
  episodes not against the newest weights are against a uniformly random player with probability r
  (its moves uniform over those the mask allows; a Box uniform within its bounds), else against a
  snapshot as above. With `fixed_players` and `fixed_probability` f, those episodes are first against
  one of the fixed players (`module:function`, services/common/players.py), drawn uniformly, with
  probability f; the random player and the snapshots share the rest. With `opponent_epsilon` e, each
  move of an opponent that is the policy (a snapshot, or the newest weights on a side not recorded) is
  a uniformly random one with probability e.
- **What is recorded:** the learning agent's steps; with `record_latest`, every agent's steps in the
  copies whose opponents are the newest weights (every side there is the policy that trains, and its
  actions are computed in the one call either way), the game seen from each side.
- **Results.** When a copy's episode ends, the learning agent *won* if its return is above every
  other agent's, *lost* if below any, else drew. Games against a snapshot update the learning
  policy's Elo rating (starting at 1000) against the snapshot's (the rating the policy had when the
  snapshot was taken, then fixed): R += K * (score - 1 / (1 + 10 ** ((R_s - R) / 400))), score 1, 0
  or 1/2. Metrics: `actor/selfplay_games_total`, `..._wins_total`, `..._losses_total`,
  `..._draws_total` (every game), `actor/selfplay_win_rate` (the last 100 games against snapshots),
  `actor/selfplay_elo` and `actor/selfplay_pool_size`; games against the random player count as
  games, not in the rating, and `actor/selfplay_random_win_rate` is the last 100 of them won; so are
  games against a fixed player, and `actor/selfplay_fixed/<module:function>_win_rate` is each one's
  last 100 won.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from services import algorithms
from services.actor.seats import Frozen, Learning, Scripted, Seats, Uniform
from services.common.agents import OUTCOMES, game_score
from services.common.models.nets import load_numpy, to_numpy
from services.common.stats import Metrics
from services.config import ExperimentConfig

START_ELO = 1000.0


class Latest:
    """An episode's opponent that is the newest weights: the training policy plays every side of the copy."""
    plays_policy = True   # (its moves are open to `opponent_epsilon`)

    def scored(self, sp: SelfPlay, score: float) -> None:
        """A game against the newest weights counts as a game, and in no rating."""


LATEST = Latest()


class Random(Uniform):
    """The uniformly random player as an opponent (`random_probability`): its games in `..._random_win_rate`."""
    plays_policy = False

    def scored(self, sp: SelfPlay, score: float) -> None:
        sp.recent_random.append(score)
        sp.metrics.set("actor/selfplay_random_win_rate", sum(s == 1.0 for s in sp.recent_random) / len(sp.recent_random))


@dataclass(eq=False)
class Fixed(Scripted):
    """A fixed player (`selfplay.fixed_players`) and the scores of the learning policy's last games against it."""
    recent: deque = field(default_factory=lambda: deque(maxlen=100))
    plays_policy = False

    def scored(self, sp: SelfPlay, score: float) -> None:
        self.recent.append(score)
        sp.metrics.set(f"actor/selfplay_fixed/{self.name}_win_rate", sum(s == 1.0 for s in self.recent) / len(self.recent))


@dataclass(eq=False)
class Snapshot(Frozen):
    """A frozen version of the policy in the pool, the rating the policy had when it was taken, and the
    learning policy's games against it in this actor."""
    rating: float = START_ELO
    games: int = 0       # games the learning policy played against it, in this actor
    points: float = 0.0  # ... and their scores' sum (a win 1, a draw 1/2)
    plays_policy = True

    def hardness(self) -> float:
        """(1 - s)^2, s the learning policy's mean score against it with one win and one loss as prior."""
        return (1.0 - (self.points + 1.0) / (self.games + 2.0)) ** 2

    def scored(self, sp: SelfPlay, score: float) -> None:
        """The game moves the learning policy's Elo rating against this snapshot's."""
        self.games += 1
        self.points += score
        expected = 1.0 / (1.0 + 10.0 ** ((self.rating - sp.rating) / 400.0))
        sp.rating += sp.sp.elo_k * (score - expected)
        sp.recent.append(score)
        sp.metrics.set("actor/selfplay_elo", sp.rating)
        sp.metrics.set("actor/selfplay_win_rate", sum(s == 1.0 for s in sp.recent) / len(sp.recent))


Opponent = Latest | Random | Fixed | Snapshot


class SelfPlay(Seats):
    """Who plays which agent of each copy, the pool of snapshots, and the games' results: the seats of the
    group of a run's one policy (rollout.py `Seats`), the training policy (`learning`) at the learning
    agents and, against the newest weights, every agent."""

    def __init__(self, cfg: ExperimentConfig, learning: Learning, copies: int, agents: int, metrics: Metrics,
                 rng: np.random.Generator):
        super().__init__(learning)
        self.cfg, self.sp, self.metrics, self.rng = cfg, cfg.selfplay, metrics, rng
        self.policy = learning.policy
        self.copies, self.agents = copies, agents
        older = self.sp.pool_size // 2 if self.sp.keep == "history" else 0
        self.newest: deque[Snapshot] = deque(maxlen=self.sp.pool_size - older)
        self.older: list[Snapshot] = []                     # keep: history's sample of what left `newest`
        self._older_max, self._left = older, 0              # (and how many have left it)
        self.learning_agent = np.zeros(copies, np.int64)    # each copy's learning agent (index in possible_agents)
        self._recorded = np.zeros(copies * agents, bool)    # the learning agents' slots
        self._latest = np.zeros(copies * agents, bool)      # the slots of copies facing the newest weights
        self._policy_side = np.zeros(copies * agents, bool)  # unrecorded slots the policy plays (snapshot or newest)
        self.opponent: list[Opponent] = [LATEST] * copies
        self.returns = np.zeros(copies * agents)            # each slot's return in the running episode
        self.rating = START_ELO
        self.recent: deque[float] = deque(maxlen=100)       # scores of the last games against snapshots
        self.recent_random: deque[float] = deque(maxlen=100)  # ... and against the random player
        space = self.policy.spec.action
        try:
            self.random = Random(space, rng)
        except ValueError as err:
            self.random = None
            if self.sp.random_probability or self.sp.opponent_epsilon:
                key = "random_probability" if self.sp.random_probability else "opponent_epsilon"
                raise ValueError(f"selfplay.{key}: {err}") from None
        try:
            self.fixed = [Fixed(name, space) for name in self.sp.fixed_players]
        except ValueError as err:
            raise ValueError(f"selfplay.fixed_players: {err}") from None
        self._seen: int | None = None                       # the last policy version looked at
        for name in ("games", "wins", "losses", "draws"):
            metrics.inc(f"actor/selfplay_{name}_total", 0)
        metrics.set("actor/selfplay_elo", self.rating)
        metrics.set("actor/selfplay_pool_size", 0)
        for k in range(copies):
            self.new_episode(k)

    @property
    def pool(self) -> list[Snapshot]:
        return self.older + list(self.newest)

    def recorded(self, present: np.ndarray | None = None) -> np.ndarray:
        """[N] bool: the learning agents' slots (kept, not built: read every step), of those `present`."""
        return self._recorded if present is None else present & self._recorded

    def new_episode(self, k: int) -> None:
        """Draw copy k's learning side and its opponent for the episode it starts."""
        self.learning_agent[k] = self.rng.integers(self.agents) if self.sp.swap_sides else 0
        pool = self.pool
        chance = self.sp.random_probability
        opponent: Opponent = LATEST
        if (pool or chance or self.fixed) and self.rng.random() >= self.sp.latest_probability:
            if self.fixed and self.rng.random() < self.sp.fixed_probability:
                opponent = self.fixed[int(self.rng.integers(len(self.fixed)))]
            elif chance and self.rng.random() < chance:
                assert self.random is not None   # (refused at construction otherwise)
                opponent = self.random
            elif not pool:
                opponent = LATEST
            elif self.sp.sampling == "prioritized":
                weights = np.array([snap.hardness() for snap in pool])
                opponent = pool[int(self.rng.choice(len(pool), p=weights / weights.sum()))]
            else:
                opponent = pool[int(self.rng.integers(len(pool)))]
        self.face(k, opponent)

    def face(self, k: int, opponent: Opponent) -> None:
        """Copy k's learning side plays `opponent` (a snapshot, a fixed player, the random player or LATEST) from
        now on: which of its slots are recorded, played by the newest weights, or open to `opponent_epsilon`."""
        slots = slice(k * self.agents, (k + 1) * self.agents)
        self.opponent[k] = opponent
        self._recorded[slots] = False
        if opponent is LATEST and self.sp.record_latest:
            self._recorded[slots] = True       # every side is the policy that trains
        else:
            self._recorded[k * self.agents + self.learning_agent[k]] = True
        self._latest[slots] = opponent is LATEST
        self._policy_side[slots] = ~self._recorded[slots] & opponent.plays_policy

    def swapped(self) -> None:
        """After the policy swapped weights in: every `snapshot_every`-th version joins the pool."""
        version = self.policy.version
        if version is None or version == self._seen:
            return
        self._seen = version
        if version % self.sp.snapshot_every:
            return
        acting = algorithms.get(self.cfg.algorithm).acting(self.cfg, self.policy.spec, self.rng, Metrics("snapshot"))
        load_numpy(acting.net, to_numpy(self.policy.net))
        acting.net.eval()
        self.add(Snapshot(version, acting, self.rating, slots=self.copies * self.agents))

    def add(self, snapshot: Snapshot) -> None:
        """Put a new snapshot in the pool, by the `keep` rule (module docstring)."""
        if len(self.newest) == self.newest.maxlen and self._older_max:
            leaving = self.newest[0]
            self._left += 1
            if len(self.older) < self._older_max:
                self.older.append(leaving)
            elif (j := int(self.rng.integers(self._left))) < self._older_max:
                self.older[j] = leaving
        self.newest.append(snapshot)
        self.metrics.set("actor/selfplay_pool_size", len(self.newest) + len(self.older))

    def act(self, obs: np.ndarray, present: np.ndarray | None, mask: np.ndarray | None, env_steps: int
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Every slot's action, and the extras the training policy recorded: the training policy acts for
        the learning agents and for the copies facing the newest weights, in one call; each other
        player in use for the copies facing it, in one call each. (Extras of the slots the policy did
        not play are 0: they are not recorded.)"""
        present = np.ones(len(obs), bool) if present is None else present
        played = present & (self._recorded | self._latest)
        rows = np.flatnonzero(played)
        space = self.policy.spec.action
        out = np.zeros((len(obs), *space.shape), space.dtype)
        recorded: dict[str, np.ndarray] = {}
        if len(rows):
            a, extras = self.learning.act(obs[rows], None if mask is None else mask[rows], env_steps, rows)
            out[rows] = a
            for name, values in extras.items():
                recorded[name] = np.zeros(len(obs), np.float32)
                recorded[name][rows] = values
        facing: dict[int, tuple[Opponent, list[int]]] = {}
        for k, opponent in enumerate(self.opponent):
            if opponent is not LATEST:
                cols = [n for n in range(k * self.agents, (k + 1) * self.agents)
                        if not self._recorded[n] and present[n]]
                facing.setdefault(id(opponent), (opponent, []))[1].extend(cols)
        for player, cols in facing.values():
            if cols:
                out[cols] = player.act(obs[cols], None if mask is None else mask[cols], env_steps, np.asarray(cols))[0]
        if self.sp.opponent_epsilon:   # the policy's opponents' moves (not the random player's), some at random
            assert self.random is not None
            noisy = np.flatnonzero(present & self._policy_side & (self.rng.random(len(obs)) < self.sp.opponent_epsilon))
            if len(noisy):
                out[noisy] = self.random.act(obs[noisy], None if mask is None else mask[noisy], env_steps)[0]
        return out, recorded

    def stepped(self, rewards: np.ndarray, ended: np.ndarray, over: np.ndarray | None) -> None:
        """Add a step's rewards; score the copies whose episode ended (`over`) and draw their next one."""
        self.learning.ended(ended)
        for snapshot in self.pool:   # (a recurrent snapshot's state in the slots it played)
            snapshot.ended(ended)
        self.returns += rewards
        if over is None:
            return
        for k in np.flatnonzero(over):
            score = game_score(self.returns[k * self.agents:(k + 1) * self.agents], int(self.learning_agent[k]))
            self.metrics.inc("actor/selfplay_games_total")
            self.metrics.inc(f"actor/selfplay_{OUTCOMES[score]}_total")
            self.opponent[k].scored(self, score)
            self.returns[k * self.agents:(k + 1) * self.agents] = 0.0
            self.new_episode(k)

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

    def scored(self, sp: Pool, score: float) -> None:
        """A game against the newest weights counts as a game, and in no rating."""


LATEST = Latest()


class Random(Uniform):
    """The uniformly random player as an opponent (`random_probability`): its games in `..._random_win_rate`."""
    plays_policy = False

    def scored(self, sp: Pool, score: float) -> None:
        sp.recent_random.append(score)
        sp.metrics.set("actor/selfplay_random_win_rate", sum(s == 1.0 for s in sp.recent_random) / len(sp.recent_random))


@dataclass(eq=False)
class Fixed(Scripted):
    """A fixed player (`selfplay.fixed_players`) and the scores of the learning policy's last games against it."""
    recent: deque = field(default_factory=lambda: deque(maxlen=100))
    plays_policy = False

    def scored(self, sp: Pool, score: float) -> None:
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

    def scored(self, sp: Pool, score: float) -> None:
        """The game moves the learning policy's Elo rating against this snapshot's."""
        self.games += 1
        self.points += score
        expected = 1.0 / (1.0 + 10.0 ** ((self.rating - sp.rating) / 400.0))
        sp.rating += sp.sp.elo_k * (score - expected)
        sp.recent.append(score)
        sp.metrics.set("actor/selfplay_elo", sp.rating)
        sp.metrics.set("actor/selfplay_win_rate", sum(s == 1.0 for s in sp.recent) / len(sp.recent))


Opponent = Latest | Random | Fixed | Snapshot


def seat_actions(learning: Learning, obs: np.ndarray, present: np.ndarray | None, mask: np.ndarray | None,
                 env_steps: int, live: np.ndarray, opponents: list[Opponent], agents: int, random: Random | None,
                 epsilon: float, rng: np.random.Generator, recorded: np.ndarray | None = None
                 ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Every slot's action in a group of copies of `agents` slots each, and the extras the training policy
    recorded: the training player acts for the `live` slots (its newest weights) in one call; each
    other player in use for the slots of the copies facing it (`opponents`, per copy), in one call
    each; with `epsilon`, that share of the moves of the slots the policy plays unrecorded (a snapshot's,
    or the newest weights' on a side not recorded: `recorded`, default `live`) are random. (Extras of
    the slots the training player did not play are 0: they are not recorded.)"""
    present = np.ones(len(obs), bool) if present is None else present
    rows = np.flatnonzero(present & live)
    space = learning.policy.spec.action
    out = np.zeros((len(obs), *space.shape), space.dtype)
    extras_out: dict[str, np.ndarray] = {}
    if len(rows):
        a, extras = learning.act(obs[rows], None if mask is None else mask[rows], env_steps, rows)
        out[rows] = a
        for name, values in extras.items():
            extras_out[name] = np.zeros(len(obs), np.float32)
            extras_out[name][rows] = values
    facing: dict[int, tuple[Opponent, list[int]]] = {}
    for k, opponent in enumerate(opponents):
        if opponent is not LATEST:
            cols = [n for n in range(k * agents, (k + 1) * agents) if not live[n] and present[n]]
            facing.setdefault(id(opponent), (opponent, []))[1].extend(cols)
    for player, cols in facing.values():
        if cols:
            out[cols] = player.act(obs[cols], None if mask is None else mask[cols], env_steps, np.asarray(cols))[0]
    if epsilon:
        assert random is not None   # (refused at construction otherwise)
        side = np.repeat([o.plays_policy for o in opponents], agents) & ~(live if recorded is None else recorded)
        noisy = np.flatnonzero(present & side & (rng.random(len(obs)) < epsilon))
        if len(noisy):
            out[noisy] = random.act(obs[noisy], None if mask is None else mask[noisy], env_steps)[0]
    return out, extras_out


class Pool:
    """One policy's snapshots (the `keep` rule), its Elo rating and its record against what it met, and
    the draw of an opponent from them (module docstring). Self-play's one policy has one; a league
    (`policies` with `selfplay`: league.py) has one per policy. `metrics`: the policy's (scoped to it in
    a league: its gauges under actor/policies/<policy>/)."""

    def __init__(self, cfg: ExperimentConfig, learning: Learning, slots: int, metrics: Metrics,
                 rng: np.random.Generator, name: str = ""):
        self.cfg, self.sp, self.metrics, self.rng = cfg, cfg.selfplay, metrics, rng
        self.learning, self.policy, self.slots, self.name = learning, learning.policy, slots, name
        older = self.sp.pool_size // 2 if self.sp.keep == "history" else 0
        self.newest: deque[Snapshot] = deque(maxlen=self.sp.pool_size - older)
        self.older: list[Snapshot] = []                     # keep: history's sample of what left `newest`
        self._older_max, self._left = older, 0              # (and how many have left it)
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
        self._counted = f"actor/policies/{name}/selfplay_" if name else "actor/selfplay_"
        for what in ("games", "wins", "losses", "draws"):
            metrics.inc(f"{self._counted}{what}_total", 0)
        metrics.set("actor/selfplay_elo", self.rating)
        metrics.set("actor/selfplay_pool_size", 0)

    @property
    def pool(self) -> list[Snapshot]:
        return self.older + list(self.newest)

    def draw(self, latest: bool = True) -> Opponent:
        """An opponent for an episode: the newest weights with probability `latest_probability` (always
        while there is nothing else; never where `latest` is False and there is), else a fixed player, the
        random player or a snapshot (module docstring)."""
        pool = self.pool
        chance = self.sp.random_probability
        if not (pool or chance or self.fixed) or (latest and self.rng.random() < self.sp.latest_probability):
            return LATEST
        if self.fixed and self.rng.random() < self.sp.fixed_probability:
            return self.fixed[int(self.rng.integers(len(self.fixed)))]
        if chance and self.rng.random() < chance:
            assert self.random is not None   # (refused at construction otherwise)
            return self.random
        if not pool:
            return LATEST
        if self.sp.sampling == "prioritized":
            weights = np.array([snap.hardness() for snap in pool])
            return pool[int(self.rng.choice(len(pool), p=weights / weights.sum()))]
        return pool[int(self.rng.integers(len(pool)))]

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
        self.add(Snapshot(version, acting, self.rating, slots=self.slots))

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

    def counted(self, score: float) -> None:
        """A game of the policy's ended with `score` (a win 1, a draw 1/2, a loss 0)."""
        self.metrics.inc(f"{self._counted}games_total")
        self.metrics.inc(f"{self._counted}{OUTCOMES[score]}_total")

    def scored(self, opponent: Opponent, score: float) -> None:
        """A game the policy played against `opponent` ended with `score`: counted, and its record (and
        rating, against a snapshot) against `opponent` moves."""
        self.counted(score)
        opponent.scored(self, score)

    def ended(self, done: np.ndarray) -> None:
        """The slots whose episode ended: every snapshot's recurrent state there starts afresh."""
        for snapshot in self.pool:
            snapshot.ended(done)


class SelfPlay(Pool, Seats):
    """Who plays which agent of each copy, the pool of snapshots, and the games' results: the seats of the
    group of a run's one policy (seats.py `Seats`), the training policy (`learning`) at the learning
    agents and, against the newest weights, every agent; its pool (`Pool`) the snapshots the others
    are played by."""

    def __init__(self, cfg: ExperimentConfig, learning: Learning, copies: int, agents: int, metrics: Metrics,
                 rng: np.random.Generator):
        Seats.__init__(self, learning)
        Pool.__init__(self, cfg, learning, copies * agents, metrics, rng)
        self.copies, self.agents = copies, agents
        self.learning_agent = np.zeros(copies, np.int64)    # each copy's learning agent (index in possible_agents)
        self._recorded = np.zeros(copies * agents, bool)    # the learning agents' slots
        self._latest = np.zeros(copies * agents, bool)      # the slots of copies facing the newest weights
        self.opponent: list[Opponent] = [LATEST] * copies
        self.returns = np.zeros(copies * agents)            # each slot's return in the running episode
        for k in range(copies):
            self.new_episode(k)

    def recorded(self, present: np.ndarray | None = None) -> np.ndarray:
        """[N] bool: the learning agents' slots (kept, not built: read every step), of those `present`."""
        return self._recorded if present is None else present & self._recorded

    def new_episode(self, k: int) -> None:
        """Draw copy k's learning side and its opponent for the episode it starts."""
        self.learning_agent[k] = self.rng.integers(self.agents) if self.sp.swap_sides else 0
        self.face(k, self.draw())

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

    def act(self, obs: np.ndarray, present: np.ndarray | None, mask: np.ndarray | None, env_steps: int
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Every slot's action, and the extras the training policy recorded (`seat_actions`): the training
        policy plays the learning agents and the copies facing the newest weights, in one call."""
        return seat_actions(self.learning, obs, present, mask, env_steps, self._recorded | self._latest,
                            self.opponent, self.agents, self.random, self.sp.opponent_epsilon, self.rng, self._recorded)

    def stepped(self, rewards: np.ndarray, ended: np.ndarray, over: np.ndarray | None) -> None:
        """Add a step's rewards; score the copies whose episode ended (`over`) and draw their next one."""
        self.learning.ended(ended)
        Pool.ended(self, ended)   # (a recurrent snapshot's state in the slots it played)
        self.returns += rewards
        if over is None:
            return
        for k in np.flatnonzero(over):
            self.scored(self.opponent[k], game_score(self.returns[k * self.agents:(k + 1) * self.agents],
                                                     int(self.learning_agent[k])))
            self.returns[k * self.agents:(k + 1) * self.agents] = 0.0
            self.new_episode(k)

"""Who plays the agents of an env of several agents: `policies` (several policies in one run, each its
agents and, with env.mode: external, its own declared spaces) and `selfplay` (one policy against snapshots
of itself). Actors seat the players by them; each policy has its own learners and its own table in every
buffer shard."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import require
from services.common.config.env import DeclaredSpaces


@dataclass(frozen=True)
class SelfPlayConfig:
    """Self-play in an env with several agents (env.id pettingzoo:..., docs/multi-agent.md): in each env
    copy one agent is played by the policy that trains and recorded; the others are played, unrecorded,
    by frozen snapshots of that policy from a pool each actor keeps."""
    enabled: bool = False
    pool_size: int = 8              # snapshots kept (which: `keep`)
    snapshot_every: int = 10        # a snapshot of every this many-th policy version the actor receives
    # At each episode of an env copy the opponents are the newest weights with this probability, else
    # a snapshot drawn from the pool (by `sampling`; the newest weights always while the pool is empty).
    latest_probability: float = 0.2
    # Of the episodes not against the newest weights, this share is against a uniformly random player
    # (the legal moves alike, where the env masks actions) instead of a snapshot: a fixed floor the
    # policy must keep beating, as RLlib's self-play examples start their league from a random policy.
    random_probability: float = 0.0
    # Fixed players (`module:function`: a function of one agent's observation, or of it and its action
    # mask, as `kuberl eval --against` takes them) the policy also meets: of the episodes not against
    # the newest weights, this share is against one of them, drawn uniformly (before the random player
    # and the snapshots are drawn among the rest). Players unlike the policy itself, as a league's
    # exploiters are: the policy cannot learn to expect its own play from every opponent.
    fixed_players: tuple[str, ...] = ()
    fixed_probability: float = 0.0
    # Each move of an opponent that is the policy (a snapshot, or the newest weights where that side is
    # not recorded) is, with this probability, a uniformly random one instead (the legal ones alike): the
    # policy meets moves its own play would not make, as it will against other players.
    opponent_epsilon: float = 0.0
    # The agent that trains is drawn uniformly from possible_agents at each episode; false: always the
    # first (for envs that draw the sides themselves).
    swap_sides: bool = True
    # Where a copy's opponents are the newest weights, every side is the policy that trains: record them
    # all (the game from each side), not the learning agent's alone. The actions are computed either way.
    record_latest: bool = False
    elo_k: float = 16.0             # the Elo update's K; ratings start at 1000
    # Which snapshots the pool keeps: "newest" (the newest pool_size) or "history" (the newest half,
    # and half a uniform sample of all older ones); and how an opponent is drawn from it: "uniform",
    # or "prioritized" (those the policy scores worst against, most often). services/actor/selfplay.py.
    keep: str = "newest"
    sampling: str = "uniform"

    def __post_init__(self) -> None:
        require(self.pool_size >= 1, "pool_size", self.pool_size, "must be >= 1")
        require(self.snapshot_every >= 1, "snapshot_every", self.snapshot_every, "must be >= 1")
        require(0.0 <= self.latest_probability <= 1.0, "latest_probability", self.latest_probability,
                "must be within 0..1")
        require(0.0 <= self.random_probability <= 1.0, "random_probability", self.random_probability,
                "must be within 0..1")
        require(0.0 <= self.opponent_epsilon <= 1.0, "opponent_epsilon", self.opponent_epsilon,
                "must be within 0..1")
        require(0.0 <= self.fixed_probability <= 1.0, "fixed_probability", self.fixed_probability,
                "must be within 0..1")
        require(not self.fixed_probability or bool(self.fixed_players), "fixed_probability", self.fixed_probability,
                "needs selfplay.fixed_players (module:function players to draw from)")
        for name in self.fixed_players:
            module, sep, attr = name.partition(":")
            require(bool(sep and module and attr), "fixed_players", name,
                    "each must be module:function (a function of one agent's observation)")
        require(self.elo_k > 0, "elo_k", self.elo_k, "must be > 0")
        require(self.keep in ("newest", "history"), "keep", self.keep,
                "must be 'newest' (the newest pool_size snapshots) or 'history' (the newest half and a "
                "uniform sample of the older ones)")
        require(self.sampling in ("uniform", "prioritized"), "sampling", self.sampling,
                "must be 'uniform' or 'prioritized' (the snapshots the policy scores worst against, most often)")


@dataclass(frozen=True)
class PolicyConfig(DeclaredSpaces):
    """One policy of several in a run (config `policies`, docs/multi-agent.md "Several policies"): the
    agents it plays, as shell-style patterns of agent ids (`fnmatch`: `red_*`, `player_[02]`); an agent
    goes to the first policy, in config order, with a pattern that matches it. With env.mode: external,
    the policy's own spaces may be declared here as `env.*` declares them (DeclaredSpaces); undeclared,
    they are the env's."""
    agents: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self._check_declared()
        require(len(self.agents) >= 1 and all(self.agents), "agents", list(self.agents),
                "name the agents this policy plays: one or more patterns of agent ids (e.g. [red_*])")

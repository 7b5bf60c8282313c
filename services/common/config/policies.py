"""Who plays the agents of an env of several agents: `policies` (several policies in one run, each its
agents and, with env.mode: external, its own declared spaces) and `selfplay` (one policy against snapshots
of itself). Actors seat the players by them; each policy has its own learners and its own table in every
buffer shard."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.common.settings import require
from services.common.config.env import DeclaredSpaces


@dataclass(frozen=True)
class SelfPlayConfig:
    """Self-play in an env with several agents (env.id pettingzoo:..., docs/multi-agent.md): in each env
    copy one agent is played by the policy that trains and recorded; the others are played, unrecorded,
    by frozen snapshots of that policy from a pool each actor keeps."""
    enabled: bool = False             # play one policy against snapshots of itself (env.id pettingzoo:...)
    pool_size: int = 8              # snapshots kept (which: `keep`)
    snapshot_every: int = 10        # a snapshot of every this many-th policy version the actor receives
    # At each episode of an env copy the opponents are the newest weights with this probability, else
    # a snapshot drawn from the pool (by `sampling`; the newest weights always while the pool is empty).
    latest_probability: float = 0.2   # share of episodes whose opponents are the newest weights
    # Of the episodes not against the newest weights, this share is against a uniformly random player
    # (the legal moves alike, where the env masks actions) instead of a snapshot: a fixed floor the
    # policy must keep beating, as RLlib's self-play examples start their league from a random policy.
    random_probability: float = 0.0   # of the other episodes, the share against a uniformly random player
    # Fixed players (`module:function`: a function of one agent's observation, or of it and its action
    # mask, as `kuberl eval --against` takes them) the policy also meets: of the episodes not against
    # the newest weights, this share is against one of them, drawn uniformly (before the random player
    # and the snapshots are drawn among the rest). Players unlike the policy itself, as a league's
    # exploiters are: the policy cannot learn to expect its own play from every opponent.
    fixed_players: tuple[str, ...] = ()  # module:function players the policy also meets (as kuberl eval --against)
    fixed_probability: float = 0.0    # of the episodes not against the newest weights, the share against a fixed player
    # Each move of an opponent that is the policy (a snapshot, or the newest weights where that side is
    # not recorded) is, with this probability, a uniformly random one instead (the legal ones alike): the
    # policy meets moves its own play would not make, as it will against other players.
    opponent_epsilon: float = 0.0     # probability that a policy opponent's move is a uniformly random one instead
    # The agent that trains is drawn uniformly from possible_agents at each episode; false: always the
    # first (for envs that draw the sides themselves).
    swap_sides: bool = True           # draw the agent that trains at each episode; false: always the first
    # Where a copy's opponents are the newest weights, every side is the policy that trains: record them
    # all (the game from each side), not the learning agent's alone. The actions are computed either way.
    record_latest: bool = False       # against the newest weights, record every side, not only the learning agent
    elo_k: float = 16.0             # the Elo update's K; ratings start at 1000
    # Which snapshots the pool keeps: "newest" (the newest pool_size) or "history" (the newest half,
    # and half a uniform sample of all older ones); and how an opponent is drawn from it: "uniform",
    # or "prioritized" (those the policy scores worst against, most often). services/actor/selfplay.py.
    keep: str = "newest"              # which snapshots the pool keeps: newest, or history (newest half, older half sampled)
    sampling: str = "uniform"         # how a snapshot is drawn: uniform, or prioritized (those it scores worst against)

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
    agents: tuple[str, ...] = ()      # agent id patterns (fnmatch, one or more): an agent goes to the first policy matching it
    # The run ends on the return once every policy with a target has reached it, each over its own agents'
    # last run.return_window episodes; run.target_return (the mean over every agent's) is then not watched.
    target_return: float | None = None   # this policy's return target (its agents' mean); null: none
    # Settings of the run's algorithm section this policy trains with instead of the run's, e.g.
    # {learning_rate: 1e-4, ent_coef: 0.02, batch_steps: 512} under ppo (a team with fewer agents makes
    # fewer samples). Only those its learners and its buffer table read (`Algorithm.per_policy`).
    overrides: dict[str, int | float | str | bool | None] = field(default_factory=dict, hash=False)  # this policy's own algorithm settings (learning rate, entropy, batch size, ...)

    def __post_init__(self) -> None:
        self._check_declared()
        require(len(self.agents) >= 1 and all(self.agents), "agents", list(self.agents),
                "name the agents this policy plays: one or more patterns of agent ids (e.g. [red_*])")

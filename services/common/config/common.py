"""CommonConfig: the sections every role reads, composed, and the checks that span sections (the env
against the policies and self-play, the topology against the planner's bounds and budget)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from services.common.settings import ConfigError, require
from services.common.net.shards import MAX_SHARDS
from services.common.net.auth import AuthConfig
from services.common.net.policy import DEFAULT as DEFAULT_POLICY, name_problem
from services.common.net.tls import TlsConfig
from services.common.config.env import EnvConfig
from services.common.config.planner import PlannerConfig
from services.common.config.policies import PolicyConfig, SelfPlayConfig
from services.common.config.roles import ActorConfig, BufferConfig, LearnerConfig, TopologyConfig
from services.common.config.run import EvalConfig, RunConfig, TrackingConfig, TuneConfig


@dataclass(frozen=True)
class CommonConfig:
    """The experiment without its algorithms' sections: what services/common reads (the whole config
    is services.config.ExperimentConfig, a CommonConfig). `algorithm` names the algorithm that trains."""
    algorithm: str = "ppo"            # the algorithm that trains; its settings: the section of its name
    seed: int = 0                     # seed of the learners' network initialisation (envs: env.seed)
    env: EnvConfig = field(default_factory=EnvConfig)  # the environment actors step and how many copies
    topology: TopologyConfig = field(default_factory=TopologyConfig)  # processes of each role kuberl up starts
    actor: ActorConfig = field(default_factory=ActorConfig)  # each actor process's settings
    buffer: BufferConfig = field(default_factory=BufferConfig)  # each buffer process's settings
    learner: LearnerConfig = field(default_factory=LearnerConfig)  # each learner process's settings
    run: RunConfig = field(default_factory=RunConfig)  # when kuberl up stops and where it writes
    evaluation: EvalConfig = field(default_factory=EvalConfig)  # how the trained policy is evaluated
    planner: PlannerConfig = field(default_factory=PlannerConfig)  # when the planner scales which role, how far
    tls: TlsConfig = field(default_factory=TlsConfig)  # TLS on every gRPC endpoint (docs/security.md)
    auth: AuthConfig = field(default_factory=AuthConfig)  # bearer tokens and session caps (docs/security.md)
    tune: TuneConfig = field(default_factory=TuneConfig)  # kuberl tune's study; kuberl up ignores it
    tracking: TrackingConfig = field(default_factory=TrackingConfig)  # the trackers kuberl up feeds (W&B, MLflow)
    selfplay: SelfPlayConfig = field(default_factory=SelfPlayConfig)  # one policy against snapshots of itself
    # Several policies in one run, by name (none: one policy, `default`, plays every agent): each its
    # own learners, weights and version, and its own table in every buffer shard.
    policies: Mapping[str, PolicyConfig] = field(default_factory=dict, hash=False)  # several policies, by name
    # Each algorithm's settings by its name (YAML: a top-level section `<name>:`), opaque here: the
    # algorithm reads its own (`Algorithm.section`); services.config.ExperimentConfig fills and checks them.
    sections: Mapping[str, Any] = field(default_factory=dict, hash=False)

    def section(self, name: str) -> Any:
        """The settings of the algorithm called `name`."""
        try:
            return self.sections[name]
        except KeyError:
            raise KeyError(f"the config has no settings for algorithm {name!r} "
                           f"(it has {', '.join(sorted(self.sections)) or 'none'})") from None

    @property
    def rollout_steps(self) -> int:
        """Steps per fragment, from the training algorithm's section (every section has one)."""
        steps: int = self.section(self.algorithm).rollout_steps
        return steps

    @property
    def hidden_sizes(self) -> tuple[int, ...]:
        sizes: tuple[int, ...] = self.section(self.algorithm).hidden_sizes
        return sizes

    @property
    def policy_names(self) -> tuple[str, ...]:
        """The run's policies in config order (`default` when the config names none)."""
        return tuple(self.policies) or (DEFAULT_POLICY,)

    @property
    def several_policies(self) -> bool:
        """Whether the run trains several policies (config `policies`), each with its own learners and table."""
        return len(self.policy_names) > 1

    def tag(self, policy: str) -> str:
        """What `policy` is called outside the code, the one place a run of one policy differs from a run of
        several: the scope of its gauges (`<role>/policies/<tag>/`), its calls' `kuberl-policy` metadata,
        its fragments', hellos' and learners' --policy, its processes' names. A run's one policy keeps the
        names a run without `policies` always had (""), each of several its name."""
        return policy if self.policies else ""

    @property
    def tags(self) -> dict[str, str]:
        """Each policy's tag (see `tag`) by its name, in config order."""
        return {name: self.tag(name) for name in self.policy_names}

    @property
    def learner_roles(self) -> dict[str, str]:
        """The roles the planner scales learners by, each with the policy it trains: `learner` for a run's
        one policy, `learner/<tag>` for each of several (the role `learner` is then all of them, watched
        but not set)."""
        return {f"learner/{tag}".rstrip("/"): name for name, tag in self.tags.items()}

    def policy(self, name: str | None) -> str:
        """The policy a learner given `name` (its --policy; None: not given) trains; ConfigError naming
        `--policy` where the run has no such policy, or several and `name` picks none."""
        names = self.policy_names
        if name is None and len(names) == 1:
            return names[0]
        if name not in names:
            raise ConfigError("--policy", f"{name!r} is not one of this run's policies ({', '.join(names)})"
                              if name is not None else f"this run trains several policies ({', '.join(names)}): "
                              f"name the one this learner trains")
        return name

    def _check_policies(self) -> None:
        for name in self.policies:
            if problem := name_problem(name):
                raise ConfigError(f"policies.{name}", problem)
        require(len(self.policies) != 1, "policies", list(self.policies),
                "name two or more policies, each with its agents (without `policies`, one policy plays every agent)")
        if not self.policies:
            return
        why = "several policies (a policy per agent group) are trained "
        require(self.env.id.startswith("pettingzoo:") or self.env.mode == "external", "policies",
                list(self.policies), why + f"in envs of several agents (env.id pettingzoo:<module>, or simulators "
                f"over EnvSession with env.mode: external), not {self.env.id!r}")
        for name, policy in self.policies.items():
            require(not policy.declares or self.env.mode == "external", f"policies.{name}.observation_shape",
                    policy.observation_shape or policy.observation_keys,
                    "a policy declares its spaces for env.mode: external; a local env's agents have their own")

    def __post_init__(self) -> None:
        self._check_policies()
        require(not self.selfplay.enabled or self.env.id.startswith("pettingzoo:"), "selfplay.enabled",
                self.selfplay.enabled, f"self-play needs an env with several agents (env.id pettingzoo:<module>), "
                f"not {self.env.id!r}")
        require(self.planner.actor.min <= self.topology.actors <= self.planner.actor.max, "topology.actors",
                self.topology.actors, f"must lie within planner.actor.min..max "
                f"({self.planner.actor.min}..{self.planner.actor.max}), the planner's bounds")
        learner = self.planner.learner
        floor = self.planner.actor.min * self.planner.actor.cost + len(self.policy_names) * learner.min * learner.cost
        learners = ("planner.learner.min" if len(self.policy_names) == 1 else
                    f"for each of the {len(self.policy_names)} policies, planner.learner.min")
        require(self.planner.budget == 0 or self.planner.budget >= floor, "planner.budget", self.planner.budget,
                f"cannot fit the minimum replicas of every role: {floor:g} (planner.actor.min and {learners}, "
                f"at their cost)")
        require(not self.planner.enabled or learner.min <= self.topology.learners <= learner.max,
                "topology.learners", self.topology.learners,
                f"must lie within planner.learner.min..max ({learner.min}..{learner.max}), the planner's bounds")
        if (shards := self.planner.buffer) is not None:
            require(1 <= shards.min and shards.max <= MAX_SHARDS, "planner.buffer", f"{shards.min}..{shards.max}",
                    f"min..max must lie within 1..{MAX_SHARDS} (buffer shards)")
            require(not self.planner.enabled or shards.min <= self.topology.buffers <= shards.max,
                    "topology.buffers", self.topology.buffers,
                    f"must lie within planner.buffer.min..max ({shards.min}..{shards.max}), the planner's bounds")

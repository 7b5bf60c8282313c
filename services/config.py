"""The experiment config: one YAML file, one frozen dataclass per concern, validated on load.

Every role reads its part of the same file: the sections of the roles (services/common/config/) and
one section per algorithm, named after it (`ppo:`, `dqn:`, `sac:`; each algorithm's `config.py`).
`load_config` refuses unknown keys, wrong types and impossible values with a ConfigError that names
the dotted key (e.g. `ppo.clip_coef`), the value and why it cannot work. Derived values are
properties; nothing is mutated after parsing.

This is the one module that knows both the roles' sections and the algorithm registry: services/common
knows no algorithm (an import-linter contract), and an algorithm reads only its own section.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import yaml

from services import algorithms
from services.common.protocol import spaces
from services.common.net.tokens import read_client_token
from services.common.config import CommonConfig
from services.common.service.runtime import with_auth_flags, with_tls_flags
from services.common.settings import ConfigError, build, plain, require
from services.common.net.tls import check_role

__all__ = ["ConfigError", "ExperimentConfig", "check_algorithm_takes", "config_from_dict", "dump_config",
           "load_config", "load_role_config"]


@dataclass(frozen=True)
class ExperimentConfig(CommonConfig):
    """The whole experiment: the roles' sections (CommonConfig) and, in `sections`, the settings of
    every registered algorithm, those not given at their defaults. `algorithm` names the one that
    trains; `section(name)` gives an algorithm's settings."""

    def __post_init__(self):
        require(self.algorithm in algorithms.REGISTRY, "algorithm", self.algorithm,
                f"must be one of {', '.join(sorted(algorithms.REGISTRY))}")
        unknown = sorted(set(self.sections) - set(algorithms.REGISTRY))
        if unknown:
            raise ConfigError(unknown[0], f"is not an algorithm (algorithms: {', '.join(sorted(algorithms.REGISTRY))})")
        sections = {}
        for name, algorithm in algorithms.REGISTRY.items():
            given = self.sections.get(name)
            if given is not None and not isinstance(given, algorithm.settings):
                raise ConfigError(name, f"must be a {algorithm.settings.__name__}, got {type(given).__name__}")
            sections[name] = algorithm.settings() if given is None else given
        object.__setattr__(self, "sections", MappingProxyType(sections))
        # Declared spaces (env.mode: external) are checked against the algorithm here, so no process
        # starts to crash on them; an env id's are checked by `kuberl up` (services/cli/up.py: checked_spec), which makes it.
        if (declared := self.env.declared_spec) is not None:
            check_algorithm_takes(self, declared, *self.env.declared_sources("env"))
        for name, policy in self.policies.items():
            if (declared := policy.declared_spec) is not None:
                check_algorithm_takes(self, declared, *policy.declared_sources(f"policies.{name}"))
        super().__post_init__()
        for name in self.policies:
            self.for_policy(name)   # (its overrides checked as its learners will build them)
        if (shards := self.topology.buffers) > 1:
            table = algorithms.get(self.algorithm).table(self)
            if isinstance(table, algorithms.ReplayTable):
                batch = algorithms.get(self.algorithm).batch_size(self)
                require(table.capacity // shards >= batch, "topology.buffers", shards,
                        f"{self.algorithm}.buffer_size {table.capacity} split over {shards} buffer shards holds "
                        f"fewer than one batch ({batch}) per shard")
        pace = self.actor.fragments_per_version
        if pace:
            algorithm = algorithms.get(self.algorithm)
            require(isinstance(algorithm.table(self), algorithms.FifoTable), "actor.fragments_per_version", pace,
                    f"paces on-policy algorithms; {self.algorithm}'s learner is paced by its replay ratio")
            samples = pace * self.rollout_steps * self.env.num_envs
            # (External sessions' fragments are rollout_steps x each session's num_envs: unknown here.)
            require(self.env.mode == "external" or samples >= algorithm.batch_size(self),
                    "actor.fragments_per_version", pace,
                    f"{pace} fragments of {self.rollout_steps} x {self.env.num_envs} steps = {samples} samples "
                    f"per version, fewer than the learner's batch of {algorithm.batch_size(self)}: a lone actor "
                    f"would wait for weights that need more of its samples")

    def for_policy(self, name: str) -> ExperimentConfig:
        """The config policy `name` trains with (its learners and its table in every buffer shard): the
        run's, with its `policies.<name>.overrides` in the algorithm's section. ConfigError naming the key
        where it sets one its algorithm keeps the run's (`Algorithm.per_policy`) or a bad value."""
        policy = self.policies.get(name)
        if policy is None or not policy.overrides:
            return self
        algorithm = algorithms.get(self.algorithm)
        prefix = f"policies.{name}.overrides."
        for key in policy.overrides:
            require(key in algorithm.per_policy, f"{prefix}{key}", policy.overrides[key],
                    f"a policy sets only its own training settings ({', '.join(algorithm.per_policy)}); "
                    f"{self.algorithm}.{key} is the run's (what its actors step and act by, or the planner balances)")
        settings = build(algorithm.settings, {**plain(self.section(self.algorithm)), **policy.overrides}, prefix)
        # Its overrides are in the section now; the derived config applies none (the others' are theirs).
        policies = {n: dataclasses.replace(p, overrides={}) for n, p in self.policies.items()}
        return dataclasses.replace(self, sections={**self.sections, self.algorithm: settings}, policies=policies)

    def with_section(self, settings) -> ExperimentConfig:
        """This config with `settings` (an algorithm's settings object) in place of that algorithm's."""
        (name,) = [n for n, a in algorithms.REGISTRY.items() if isinstance(settings, a.settings)]
        return dataclasses.replace(self, sections={**self.sections, name: settings})

    def to_dict(self) -> dict:
        """The config as plain data, in the YAML file's shape (each algorithm's section at the top level)."""
        out = {}
        for f in dataclasses.fields(self):
            if f.name != "sections":
                out[f.name] = plain(getattr(self, f.name))
            if f.name == "env":   # where the algorithms' sections always stood in the file
                out.update({name: plain(settings) for name, settings in self.sections.items()})
        return out


def check_algorithm_takes(cfg: CommonConfig, spec: spaces.EnvSpec, action: str, obs: str) -> None:
    """ConfigError naming `algorithm` unless the config's algorithm can train on an env of `spec`
    (`Algorithm.check_spec`); `action` and `obs` say where the spaces come from, e.g.
    "algorithm: sac takes Box actions with bounds finite in float32 with low < high; env.action_space is
    Discrete(3)"."""
    try:
        algorithms.get(cfg.algorithm).check_spec(spec, action, obs)
    except ValueError as err:
        raise ConfigError("algorithm", str(err).removeprefix("algorithm: ")) from None


def config_from_dict(data: dict | None) -> ExperimentConfig:
    """Build and validate an ExperimentConfig from plain data; raises ConfigError naming the key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"the config must be a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(ExperimentConfig) if f.name != "sections"} | set(algorithms.REGISTRY)
    for k in data:
        if k not in known:
            raise ConfigError(str(k), f"unknown key (known keys here: {', '.join(sorted(known))})")
    sections = {}
    for name, value in data.items():
        if name in algorithms.REGISTRY:
            if value is not None and not isinstance(value, dict):
                raise ConfigError(name, f"must be a mapping of settings, got {type(value).__name__}")
            sections[name] = build(algorithms.REGISTRY[name].settings, value or {}, f"{name}.")
    common = {k: v for k, v in data.items() if k not in algorithms.REGISTRY}
    return build(ExperimentConfig, common, sections=sections)


def load_config(path: str | Path | None) -> ExperimentConfig:
    """Load a YAML experiment config (None = all defaults: CartPole-v1 with PPO)."""
    if path is None:
        return ExperimentConfig()
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError("<file>", f"{path} is not valid YAML: {e}") from None
    return config_from_dict(data)


def dump_config(cfg: ExperimentConfig, path: str | Path) -> None:
    """Write the resolved config (every default filled in) as YAML."""
    Path(path).write_text(yaml.safe_dump(cfg.to_dict(), sort_keys=False))


def load_role_config(args: argparse.Namespace):
    """The experiment config of a role process: --config's file with the --tls-* and token flags over it,
    its TLS files and the token it sends checked (a ConfigError, TlsError or AuthError ends the process with
    exit code 2, see run_service)."""
    cfg = with_auth_flags(with_tls_flags(load_config(args.config), args), args)
    check_role(cfg.tls)
    if cfg.auth.client_token_file:  # read at every call later (rotation); a missing one must not go unnoticed
        read_client_token(cfg.auth.client_token_file, "auth.client_token_file (--token-file, $KUBERL_TOKEN_FILE)")
    return cfg

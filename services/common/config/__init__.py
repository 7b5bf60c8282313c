"""The sections of the experiment config that every role reads (one frozen dataclass per concern, checked
as it is built), each module beside what reads it:

- env.py: `env`: the environment actors step, Atari's preprocessing, the spaces declared for simulators.
- roles.py: `topology`, and each role process's own settings: `actor`, `buffer`, `learner`.
- policies.py: `policies` and `selfplay`: who plays the agents of an env of several agents.
- planner.py: `planner`: its measurements, rules and bounds, and its Kubernetes backend.
- run.py: what only the CLI reads: `run`, `tracking`, `tune`, `evaluation`.
- common.py: `CommonConfig`, composing them (with `tls` and `auth`, services/common/net), and the checks
  that span sections.

The experiment config itself, with the section of each algorithm (services/algorithms/<name>/config.py),
is services/config.py; this package knows no algorithm. `CommonConfig` holds these sections; code in
services/common takes it, and the whole ExperimentConfig is one. Import every name from here
(`services.common.config`); the modules import each other in one direction only, env.py first and
common.py last. ConfigError and `require` are services/common/settings.py's: every section's errors name
the key at fault, "<key>: <value> is invalid: <why>".
"""

from services.common.settings import ConfigError, require
from services.common.net.auth import AuthConfig
from services.common.net.tls import TlsConfig
from services.common.config.env import ActionSpaceConfig, AtariConfig, DeclaredSpaces, EnvConfig, is_atari
from services.common.config.roles import ActorConfig, BufferConfig, LearnerConfig, TopologyConfig
from services.common.config.policies import PolicyConfig, SelfPlayConfig
from services.common.config.planner import KubernetesPlannerConfig, PlannerConfig, RolePlanConfig
from services.common.config.run import (TUNE_METRICS, TUNE_PRUNERS, TUNE_SAMPLERS, TUNE_TYPES, WANDB_MODES, EvalConfig,
                                        MlflowTracking, RunConfig, TrackingConfig, TuneConfig, TuneParam,
                                        WandbTracking)
from services.common.config.common import CommonConfig

__all__ = [
    "TUNE_METRICS", "TUNE_PRUNERS", "TUNE_SAMPLERS", "TUNE_TYPES", "WANDB_MODES",
    "ActionSpaceConfig", "ActorConfig", "AtariConfig", "AuthConfig", "BufferConfig", "CommonConfig", "ConfigError",
    "DeclaredSpaces", "EnvConfig", "EvalConfig", "KubernetesPlannerConfig", "LearnerConfig", "MlflowTracking",
    "PlannerConfig", "PolicyConfig", "RolePlanConfig", "RunConfig", "SelfPlayConfig", "TlsConfig", "TopologyConfig",
    "TrackingConfig", "TuneConfig", "TuneParam", "WandbTracking", "is_atari", "require",
]

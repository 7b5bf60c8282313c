"""The experiment config: one YAML file, one frozen dataclass per concern, validated on load.

Every role reads its part of the same file. `load_config` refuses unknown keys, wrong types and
impossible values with a ConfigError that names the dotted key (e.g. `ppo.clip_coef`), the value
and why it cannot work. Derived values are properties; nothing is mutated after parsing.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """An invalid experiment config; the message starts with the dotted key at fault."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def _require(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(key, f"{value!r} is invalid: {why}")


@dataclass(frozen=True)
class EnvConfig:
    """Which environment actors step and how many copies each actor runs.

    mode "local": each actor steps `num_envs` copies of the gymnasium env `id`.
    mode "external": simulators connect to the actor over EnvSession and step themselves; the policy's
    spaces come from `observation_shape` / `observation_dtype` / `num_actions` when given, else from
    the gymnasium env `id` (e.g. CartPole-v1 for a CartPole written in another language).
    """
    id: str = "CartPole-v1"           # gymnasium id
    num_envs: int = 8                 # env copies per actor (one vector env); local mode
    seed: int = 0                     # base seed; actor i uses seed + 1000 * i
    max_episode_steps: int | None = None  # override the env's time limit
    mode: str = "local"               # "local" or "external"
    observation_shape: tuple[int, ...] | None = None  # external envs not in gymnasium: declare the spaces
    observation_dtype: str = "float32"
    num_actions: int | None = None

    def __post_init__(self):
        _require(self.mode in ("local", "external"), "mode", self.mode, "must be 'local' or 'external'")
        _require((self.observation_shape is None) == (self.num_actions is None), "observation_shape",
                 self.observation_shape, "declare observation_shape and num_actions together (or neither)")
        _require(self.observation_shape is None or self.mode == "external", "observation_shape",
                 self.observation_shape, "declared spaces are for env.mode: external; local envs have their own")
        _require(self.observation_shape is None or all(d >= 1 for d in self.observation_shape),
                 "observation_shape", self.observation_shape, "every dimension must be >= 1")
        _require(self.num_actions is None or self.num_actions >= 1, "num_actions", self.num_actions, "must be >= 1")
        _require(self.observation_dtype in ("float32", "float64", "uint8", "int32", "int64"), "observation_dtype",
                 self.observation_dtype, "must be float32, float64, uint8, int32 or int64")
        _require(bool(self.id), "id", self.id, "an env id is required")
        _require(1 <= self.num_envs <= 4096, "num_envs", self.num_envs, "must be 1..4096")
        _require(self.max_episode_steps is None or self.max_episode_steps > 0, "max_episode_steps",
                 self.max_episode_steps, "must be positive")


@dataclass(frozen=True)
class PPOConfig:
    """PPO (clipped objective, GAE), as in CleanRL's ppo.py; a batch is whole fragments."""
    rollout_steps: int = 64           # T: steps per env in one fragment
    batch_steps: int = 512            # steps per learner batch (whole fragments, at least this many)
    num_epochs: int = 4               # passes over each batch
    num_minibatches: int = 4          # minibatches per epoch
    learning_rate: float = 1e-3
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_coef: float = 0.2
    clip_vloss: bool = True
    ent_coef: float = 0.0
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    norm_adv: bool = True
    hidden_sizes: tuple[int, ...] = (64, 64)
    # Staleness bound (DESIGN.md section 4): a fragment whose policy_version is more than this many
    # learner updates (batches) behind when it is consumed is stale. None = no bound.
    max_policy_lag: int | None = 8
    # What happens to stale fragments: "correct" (trained on with V-trace targets and truncated
    # importance weights, Espeholt et al. 2018) or "drop" (counted, never trained on). docs/staleness.md
    # measured correct reaching a return of 475 on CartPole in 6.8 s against 9.8 s for drop.
    stale_fragments: str = "correct"
    vtrace_rho_bar: float = 1.0       # truncation of the importance weight rho in V-trace
    vtrace_c_bar: float = 1.0         # truncation of the trace-cutting weight c in V-trace

    def __post_init__(self):
        _require(self.max_policy_lag is None or self.max_policy_lag >= 0, "max_policy_lag", self.max_policy_lag,
                 "must be >= 0 (0 = train only on fragments from the current policy), or null for no bound")
        _require(self.stale_fragments in ("drop", "correct"), "stale_fragments", self.stale_fragments,
                 "must be 'drop' or 'correct'")
        _require(self.vtrace_rho_bar > 0 and self.vtrace_c_bar > 0, "vtrace_rho_bar",
                 (self.vtrace_rho_bar, self.vtrace_c_bar), "V-trace truncation levels must be > 0")
        _require(1 <= self.rollout_steps <= 65536, "rollout_steps", self.rollout_steps, "must be 1..65536")
        _require(self.batch_steps >= 1, "batch_steps", self.batch_steps, "must be >= 1")
        _require(self.num_epochs >= 1, "num_epochs", self.num_epochs, "must be >= 1")
        _require(1 <= self.num_minibatches <= self.batch_steps, "num_minibatches", self.num_minibatches,
                 "must be 1..batch_steps, or minibatches would be empty")
        _require(self.learning_rate > 0, "learning_rate", self.learning_rate, "must be > 0")
        _require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        _require(0 <= self.gae_lambda <= 1, "gae_lambda", self.gae_lambda, "must be in [0, 1]")
        _require(self.clip_coef > 0, "clip_coef", self.clip_coef, "must be > 0")
        _require(self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "must be > 0")
        _require(all(h > 0 for h in self.hidden_sizes), "hidden_sizes", self.hidden_sizes,
                 "every layer needs a positive width")


@dataclass(frozen=True)
class DQNConfig:
    """Double DQN with a target network, as in CleanRL's dqn.py; uniform replay in the buffer."""
    rollout_steps: int = 16           # T: steps per env in one fragment
    buffer_size: int = 50_000         # replay capacity in transitions
    batch_size: int = 128             # transitions per update
    learning_rate: float = 1e-3
    gamma: float = 0.99
    target_update_interval: int = 250  # updates between target-network syncs
    tau: float = 1.0                  # 1.0 = hard copy
    learning_starts: int = 1000       # transitions stored before the buffer serves batches
    # Target replay ratio: transitions trained on per transition inserted. The buffer holds back
    # batches from a learner that runs ahead of production (it never blocks inserts); a learner too
    # slow for the target shows as a ratio below the band. 0 = serve as fast as the learner reads.
    replay_ratio: float = 8.0
    replay_ratio_tolerance: float = 0.1  # the band is target * (1 +- tolerance)
    start_epsilon: float = 1.0
    end_epsilon: float = 0.05
    exploration_steps: int = 10_000   # env steps (per actor) to anneal epsilon over
    double_dqn: bool = True
    max_grad_norm: float = 10.0
    hidden_sizes: tuple[int, ...] = (128, 128)

    def __post_init__(self):
        _require(1 <= self.rollout_steps <= 65536, "rollout_steps", self.rollout_steps, "must be 1..65536")
        _require(self.buffer_size >= self.batch_size, "buffer_size", self.buffer_size,
                 f"must hold at least one batch ({self.batch_size})")
        _require(self.batch_size >= 1, "batch_size", self.batch_size, "must be >= 1")
        _require(self.learning_rate > 0, "learning_rate", self.learning_rate, "must be > 0")
        _require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        _require(self.target_update_interval >= 1, "target_update_interval", self.target_update_interval,
                 "must be >= 1")
        _require(0 < self.tau <= 1, "tau", self.tau, "must be in (0, 1]")
        _require(self.batch_size <= self.learning_starts <= self.buffer_size, "learning_starts",
                 self.learning_starts, f"must be between batch_size ({self.batch_size}) and buffer_size "
                                       f"({self.buffer_size}), or the first batch could never be cut")
        _require(self.replay_ratio >= 0, "replay_ratio", self.replay_ratio, "must be >= 0 (0 = unpaced)")
        _require(0 < self.replay_ratio_tolerance < 1, "replay_ratio_tolerance", self.replay_ratio_tolerance,
                 "must be in (0, 1)")
        for name in ("start_epsilon", "end_epsilon"):
            _require(0 <= getattr(self, name) <= 1, name, getattr(self, name), "must be in [0, 1]")
        _require(self.exploration_steps >= 1, "exploration_steps", self.exploration_steps, "must be >= 1")
        _require(self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "must be > 0")
        _require(all(h > 0 for h in self.hidden_sizes), "hidden_sizes", self.hidden_sizes,
                 "every layer needs a positive width")


@dataclass(frozen=True)
class TopologyConfig:
    """How many processes of each role `kuberl up` starts."""
    actors: int = 1
    learners: int = 1
    buffers: int = 1

    def __post_init__(self):
        _require(1 <= self.actors <= 256, "actors", self.actors, "must be 1..256")
        _require(self.learners == 1, "learners", self.learners,
                 "only one learner per experiment is supported so far (no gradient all-reduce yet)")
        _require(self.buffers == 1, "buffers", self.buffers,
                 "only one buffer per experiment is supported so far (no sharding yet)")


@dataclass(frozen=True)
class ActorConfig:
    """Actor process settings."""
    queue_fragments: int = 64         # bounded send queue; the oldest fragment is dropped (and counted) when full
    push_ack_interval_s: float = 2.0  # a push stream is half-closed and acknowledged this often
    torch_threads: int = 1
    # Cap on env steps per second (all of this actor's envs together); 0 = as fast as possible.
    # Sleeping here frees the CPU for the learner on a shared machine; the actor never waits on the network.
    max_env_steps_per_s: float = 0.0
    # External simulators (env.mode: external):
    max_sessions: int = 256            # concurrent EnvSession streams; more get RESOURCE_EXHAUSTED
    session_timeout_s: float = 30.0    # a session silent this long is closed (DEADLINE_EXCEEDED)
    session_resume_s: float = 300.0    # a session_id reconnecting within this resumes its episodes

    def __post_init__(self):
        _require(self.max_sessions >= 1, "max_sessions", self.max_sessions, "must be >= 1")
        _require(self.session_timeout_s > 0, "session_timeout_s", self.session_timeout_s, "must be > 0")
        _require(self.session_resume_s >= 0, "session_resume_s", self.session_resume_s, "must be >= 0")
        _require(self.max_env_steps_per_s >= 0, "max_env_steps_per_s", self.max_env_steps_per_s, "must be >= 0")
        _require(self.queue_fragments >= 1, "queue_fragments", self.queue_fragments, "must be >= 1")
        _require(self.push_ack_interval_s > 0, "push_ack_interval_s", self.push_ack_interval_s, "must be > 0")
        _require(self.torch_threads >= 1, "torch_threads", self.torch_threads, "must be >= 1")


@dataclass(frozen=True)
class BufferConfig:
    """Buffer process settings."""
    max_message_mb: int = 64          # largest fragment accepted / batch sent, MiB
    fifo_capacity_steps: int = 8192   # PPO: steps held before the oldest fragment is evicted (counted)
    batch_prefetch: int = 2           # batches cut ahead of the learner per stream

    def __post_init__(self):
        _require(1 <= self.max_message_mb <= 1024, "max_message_mb", self.max_message_mb, "must be 1..1024")
        _require(self.fifo_capacity_steps >= 1, "fifo_capacity_steps", self.fifo_capacity_steps, "must be >= 1")
        _require(self.batch_prefetch >= 1, "batch_prefetch", self.batch_prefetch, "must be >= 1")


@dataclass(frozen=True)
class LearnerConfig:
    """Learner process settings."""
    publish_interval_updates: int = 1  # K: publish weights every K updates
    checkpoint_interval_s: float = 60.0  # T: also checkpoint on shutdown
    keep_checkpoints: int = 3
    torch_threads: int = 1
    device: str = "cpu"

    def __post_init__(self):
        _require(self.publish_interval_updates >= 1, "publish_interval_updates",
                 self.publish_interval_updates, "must be >= 1")
        _require(self.checkpoint_interval_s > 0, "checkpoint_interval_s", self.checkpoint_interval_s, "must be > 0")
        _require(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints, "must be >= 1")
        _require(self.torch_threads >= 1, "torch_threads", self.torch_threads, "must be >= 1")
        _require(self.device == "cpu" or self.device.startswith("cuda"), "device", self.device,
                 "must be 'cpu' or 'cuda[:N]'")


@dataclass(frozen=True)
class RunConfig:
    """When `kuberl up` stops and where it writes."""
    target_return: float | None = 475.0  # stop when the mean return over `return_window` episodes reaches it
    return_window: int = 100
    max_env_steps: int = 1_000_000    # stop after this many env steps (all actors together)
    max_seconds: float | None = None  # stop after this much wall time
    run_dir: str = "runs"             # parent directory of run directories
    poll_interval_s: float = 1.0      # stats polling and progress period

    def __post_init__(self):
        _require(self.return_window >= 1, "return_window", self.return_window, "must be >= 1")
        _require(self.max_env_steps >= 1, "max_env_steps", self.max_env_steps, "must be >= 1")
        _require(self.max_seconds is None or self.max_seconds > 0, "max_seconds", self.max_seconds, "must be > 0")
        _require(self.poll_interval_s > 0, "poll_interval_s", self.poll_interval_s, "must be > 0")


@dataclass(frozen=True)
class ExperimentConfig:
    """The whole experiment. `algorithm` picks which of `ppo` / `dqn` applies."""
    algorithm: str = "ppo"
    seed: int = 0
    env: EnvConfig = field(default_factory=EnvConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dqn: DQNConfig = field(default_factory=DQNConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        _require(self.algorithm in ("ppo", "dqn"), "algorithm", self.algorithm, "must be 'ppo' or 'dqn'")

    @property
    def rollout_steps(self) -> int:
        return self.ppo.rollout_steps if self.algorithm == "ppo" else self.dqn.rollout_steps

    @property
    def hidden_sizes(self) -> tuple[int, ...]:
        return self.ppo.hidden_sizes if self.algorithm == "ppo" else self.dqn.hidden_sizes

    def to_dict(self) -> dict:
        return _plain(dataclasses.asdict(self))


def _plain(value):
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


_YAML11_FLOAT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)[eE][-+]?\d+")


def _convert(tp, value, key: str):
    """Check `value` against the annotation `tp` (strictly: no bool for int, no str for float)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, key)
    if dataclasses.is_dataclass(tp):
        if value is None:  # `section:` with nothing under it means "all defaults"
            value = {}
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a mapping of settings, got {type(value).__name__}")
        return _build(tp, value, key + ".")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"must be a list, got {type(value).__name__} {value!r}")
        (item, _) = typing.get_args(tp)
        return tuple(_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _YAML11_FLOAT.fullmatch(value.strip()):
        return float(value)  # PyYAML (YAML 1.1) reads `1e-3` as a string; users mean the number
    if tp is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if tp in (str, bool) and isinstance(value, tp):
        return value
    raise ConfigError(key, f"must be {getattr(tp, '__name__', tp)}, got {type(value).__name__} {value!r}")


def _build(cls, data: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    for k in data:
        if k not in names:
            raise ConfigError(f"{prefix}{k}", f"unknown key (known keys here: {', '.join(sorted(names))})")
    kwargs = {k: _convert(hints[k], v, f"{prefix}{k}") for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if e.key.startswith(prefix) and prefix:
            raise
        raise ConfigError(f"{prefix}{e.key}", str(e).split(": ", 1)[1]) from None


def config_from_dict(data: dict | None) -> ExperimentConfig:
    """Build and validate an ExperimentConfig from plain data; raises ConfigError naming the key."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError("<root>", f"the config must be a mapping, got {type(data).__name__}")
    return _build(ExperimentConfig, data)


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

"""The experiment config: one YAML file, one frozen dataclass per concern, validated on load.

Every role reads its part of the same file. `load_config` refuses unknown keys, wrong types and
impossible values with a ConfigError that names the dotted key (e.g. `ppo.clip_coef`), the value
and why it cannot work. Derived values are properties; nothing is mutated after parsing.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from services import algorithms
from services.common import spaces
from services.common.fragments import DEDUPE_WINDOW


class ConfigError(ValueError):
    """An invalid experiment config; the message starts with the dotted key at fault."""

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def _require(cond: bool, key: str, value: Any, why: str) -> None:
    if not cond:
        raise ConfigError(key, f"{value!r} is invalid: {why}")


@dataclass(frozen=True)
class AtariConfig:
    """Preprocessing of Atari games (env ids `ALE/<Game>-v5`), after Machado et al. 2018 and the
    Nature DQN: frames are 84x84 grey uint8, the last `frame_stack` stacked, `frameskip` frames per
    action (max-pooled over the last two), up to `noop_max` no-ops at reset. Observations stay uint8
    all the way to the learner; the networks divide by 255 inside their forward pass.
    """
    # "ale_vector": ale-py's native, multi-threaded AtariVectorEnv (fast; the default);
    # "gymnasium": gymnasium's ALE/*-v5 env per copy with AtariPreprocessing + FrameStackObservation.
    backend: str = "ale_vector"
    frame_stack: int = 4
    frameskip: int = 4
    screen_size: int = 84
    noop_max: int = 30
    # A lost life is a terminal step in fragments (no bootstrap through it) while the game goes on,
    # as SB3's and CleanRL's EpisodicLifeEnv; episode returns are still logged per whole game.
    # Off by default: Pong has no lives.
    episodic_life: bool = False
    # Rewards stored in fragments are sign(r) (Mnih et al. 2015); episode returns are logged unclipped.
    clip_rewards: bool = True
    # Sticky actions: 0.0 as in the NoFrameskip-v4 setting of CleanRL and the SB3 zoo (v5 defaults to 0.25).
    repeat_action_probability: float = 0.0
    full_action_space: bool = False
    threads: int = 1                  # ale_vector worker threads per actor (0 = one per core)

    def __post_init__(self):
        _require(self.backend in ("ale_vector", "gymnasium"), "backend", self.backend,
                 "must be 'ale_vector' or 'gymnasium'")
        _require(1 <= self.frame_stack <= 16, "frame_stack", self.frame_stack, "must be 1..16")
        _require(1 <= self.frameskip <= 16, "frameskip", self.frameskip, "must be 1..16")
        _require(16 <= self.screen_size <= 256, "screen_size", self.screen_size, "must be 16..256")
        _require(0 <= self.noop_max <= 1000, "noop_max", self.noop_max, "must be 0..1000")
        _require(0.0 <= self.repeat_action_probability < 1.0, "repeat_action_probability",
                 self.repeat_action_probability, "must be in [0, 1)")
        _require(0 <= self.threads <= 256, "threads", self.threads, "must be 0..256 (0 = one per core)")


def is_atari(env_id: str) -> bool:
    """True for the Atari ids actors preprocess (`ALE/<Game>-v5`)."""
    return env_id.startswith("ALE/")


@dataclass(frozen=True)
class ActionSpaceConfig:
    """An action space declared in the config (`env.action_space`), for simulators not in gymnasium.

        action_space: {type: discrete, n: 4}
        action_space: {type: multi_discrete, nvec: [3, 3, 2]}
        action_space: {type: box, shape: [2], low: [-1.0], high: [1.0]}   # float32; bounds optional

    Box bounds: one value for every element or one per element (row-major); omitted = unbounded.
    """
    type: str
    n: int | None = None
    nvec: tuple[int, ...] | None = None
    shape: tuple[int, ...] | None = None
    low: tuple[float, ...] | None = None
    high: tuple[float, ...] | None = None

    def __post_init__(self):
        kinds = {"discrete": ("n",), "multi_discrete": ("nvec",), "box": ("shape", "low", "high")}
        _require(self.type in kinds, "type", self.type, "must be discrete, multi_discrete or box")
        for name in ("n", "nvec", "shape", "low", "high"):
            _require(getattr(self, name) is None or name in kinds[self.type], name, getattr(self, name),
                     f"is not a setting of a {self.type} space (it takes {', '.join(kinds[self.type])})")
        _require(self.type != "discrete" or (self.n is not None and self.n >= 1), "n", self.n,
                 "a discrete space needs n >= 1")
        _require(self.type != "multi_discrete" or bool(self.nvec), "nvec", self.nvec,
                 "a multi_discrete space needs nvec, one count per choice")
        _require(self.type != "box" or bool(self.shape), "shape", self.shape, "a box space needs a shape")
        try:
            self.space()
        except ValueError as err:
            raise ConfigError("nvec" if self.type == "multi_discrete" else "shape", str(err)) from None

    def space(self) -> spaces.ActionSpace:
        """The space as services.common.spaces has it (ValueError if it cannot be one)."""
        if self.type == "discrete":
            return spaces.Discrete(self.n)
        if self.type == "multi_discrete":
            return spaces.checked(spaces.MultiDiscrete(tuple(self.nvec)))
        inf = float("inf")
        return spaces.checked(spaces.Box.of(self.shape, self.low if self.low else -inf,
                                            self.high if self.high else inf))


@dataclass(frozen=True)
class EnvConfig:
    """Which environment actors step and how many copies each actor runs.

    mode "local": each actor steps `num_envs` copies of the gymnasium env `id`.
    mode "external": simulators connect to the actor over EnvSession and step themselves; the policy's
    spaces are the declared ones when given (an observation Box or Dict, and an action space), else
    those of the gymnasium env `id` (e.g. CartPole-v1 for a CartPole written in another language).
    """
    id: str = "CartPole-v1"           # gymnasium id
    num_envs: int = 8                 # env copies per actor (one vector env); local mode
    seed: int = 0                     # base seed; actor i uses seed + 1000 * i
    max_episode_steps: int | None = None  # override the env's time limit
    mode: str = "local"               # "local" or "external"
    # External envs not in gymnasium declare the spaces: an observation Box (observation_shape and
    # observation_dtype) or Dict (observation_keys: each key's shape; flattened into float32, keys
    # sorted), and the action space (action_space, or num_actions as shorthand for a Discrete one).
    observation_shape: tuple[int, ...] | None = None
    observation_dtype: str = "float32"
    observation_keys: dict[str, tuple[int, ...]] | None = None
    num_actions: int | None = None
    action_space: ActionSpaceConfig | None = None
    atari: AtariConfig = field(default_factory=AtariConfig)  # used when `id` is ALE/<Game>-v5

    def __post_init__(self):
        _require(not is_atari(self.id) or re.fullmatch(r"ALE/[A-Za-z0-9]+-v5", self.id) is not None, "id",
                 self.id, "Atari ids are ALE/<Game>-v5, e.g. ALE/Pong-v5")
        _require(self.mode in ("local", "external"), "mode", self.mode, "must be 'local' or 'external'")
        _require(self.num_actions is None or self.action_space is None, "num_actions", self.num_actions,
                 "give num_actions (a Discrete space) or action_space, not both")
        _require(self.observation_shape is None or self.observation_keys is None, "observation_keys",
                 self.observation_keys, "give observation_shape (a Box) or observation_keys (a Dict), not both")
        declared_obs = self.observation_shape is not None or self.observation_keys is not None
        declared_act = self.num_actions is not None or self.action_space is not None
        _require(declared_obs == declared_act, "observation_shape" if declared_act else "action_space",
                 self.observation_shape if declared_act else self.action_space,
                 "declare the observation space (observation_shape or observation_keys) and the action "
                 "space (action_space or num_actions) together, or neither")
        _require(not declared_obs or self.mode == "external", "observation_shape", self.observation_shape,
                 "declared spaces are for env.mode: external; local envs have their own")
        _require(self.observation_shape is None or all(d >= 1 for d in self.observation_shape),
                 "observation_shape", self.observation_shape, "every dimension must be >= 1")
        for key, shape in (self.observation_keys or {}).items():
            _require(0 < len(key) <= 64 and all(d >= 1 for d in shape), f"observation_keys.{key}", list(shape),
                     "keys of 1..64 characters, every dimension >= 1")
        _require(self.observation_keys is None or 0 < len(self.observation_keys) <= 64, "observation_keys",
                 self.observation_keys, "1..64 keys")
        if self.observation_keys is not None:
            try:
                spaces.dict_layout(self.observation_keys)
            except ValueError as err:
                raise ConfigError("observation_keys", str(err)) from None
        _require(self.num_actions is None or self.num_actions >= 1, "num_actions", self.num_actions, "must be >= 1")
        _require(self.observation_dtype in ("float32", "float64", "uint8", "int32", "int64"), "observation_dtype",
                 self.observation_dtype, "must be float32, float64, uint8, int32 or int64")
        _require(self.observation_keys is None or self.observation_dtype == "float32", "observation_dtype",
                 self.observation_dtype, "a Dict observation is flattened into float32")
        _require(bool(self.id), "id", self.id, "an env id is required")
        _require(1 <= self.num_envs <= 4096, "num_envs", self.num_envs, "must be 1..4096")
        _require(self.max_episode_steps is None or self.max_episode_steps > 0, "max_episode_steps",
                 self.max_episode_steps, "must be positive")

    @property
    def declared_action_space(self) -> spaces.ActionSpace | None:
        """The action space the config declares (None: the gymnasium env's)."""
        if self.num_actions is not None:
            return spaces.Discrete(self.num_actions)
        return None if self.action_space is None else self.action_space.space()

    @property
    def declared_spec(self) -> spaces.EnvSpec | None:
        """The policy's spaces as the config declares them (None: the gymnasium env's, `id`)."""
        action = self.declared_action_space
        if action is None:
            return None
        if self.observation_keys is not None:
            keys = spaces.dict_layout(self.observation_keys)
            return spaces.EnvSpec((spaces.flat_size(keys),), np.dtype(np.float32), action, keys)
        return spaces.EnvSpec(tuple(self.observation_shape), np.dtype(self.observation_dtype), action)

    @property
    def declared_sources(self) -> tuple[str, str]:
        """The keys that declare the action and observation spaces, as `Algorithm.check_spec` names them."""
        action = "env.num_actions" if self.num_actions is not None else "env.action_space"
        obs = ("the declared observations (env.observation_keys)" if self.observation_keys is not None
               else "the declared observations (env.observation_shape, env.observation_dtype)")
        return action, obs


def check_algorithm_takes(cfg: ExperimentConfig, spec: spaces.EnvSpec, action: str, obs: str) -> None:
    """ConfigError naming `algorithm` unless the config's algorithm can train on an env of `spec`
    (`Algorithm.check_spec`); `action` and `obs` say where the spaces come from, e.g.
    "algorithm: sac takes Box actions with bounds finite in float32 with low < high; env.action_space is
    Discrete(3)"."""
    try:
        algorithms.get(cfg.algorithm).check_spec(spec, action, obs)
    except ValueError as err:
        raise ConfigError("algorithm", str(err).removeprefix("algorithm: ")) from None


@dataclass(frozen=True)
class PPOConfig:
    """PPO (clipped objective, GAE), as in CleanRL's ppo.py; a batch is whole fragments."""
    rollout_steps: int = 64           # T: steps per env in one fragment
    batch_steps: int = 512            # steps per learner batch (whole fragments, at least this many)
    num_epochs: int = 10              # passes over each batch (SB3's default; bench/zoo.py: 4 left CartPole
                                      # short of 475 in 100k steps and took Acrobot 63k steps to -100, 10 took 46.8k)
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
    # Staleness bound (docs/architecture.md section 4): a fragment whose policy_version is more than
    # this many learner updates (batches) behind when it is consumed is stale. None = no bound.
    max_policy_lag: int | None = 8
    # What happens to stale fragments: "correct" (trained on with V-trace targets and truncated
    # importance weights, Espeholt et al. 2018) or "drop" (counted, never trained on). docs/staleness.md
    # measured correct reaching a return of 475 on CartPole in 6.8 s against 9.8 s for drop.
    stale_fragments: str = "correct"
    vtrace_rho_bar: float = 1.0       # truncation of the importance weight rho in V-trace
    vtrace_c_bar: float = 1.0         # truncation of the trace-cutting weight c in V-trace
    # Rewards are multiplied by this before returns and advantages are computed (the episode returns
    # kuberl reports stay unscaled). Continuous-control rewards such as Pendulum's -16..0 give value
    # targets in the hundreds; a scale of 0.1 keeps them near 1, as SB3's VecNormalize does adaptively.
    reward_scale: float = 1.0
    # Observations normalised by a running mean and variance, clipped to +-obs_clip (gymnasium's
    # NormalizeObservation, SB3's VecNormalize), for flat (non-image) observations. The statistics
    # are buffers of the network: the learner updates them from every batch it trains on (summed over
    # a learner group) and they reach actors with the weights, so both normalise alike.
    normalize_observations: bool = False
    obs_clip: float = 10.0
    # Rewards divided by the running standard deviation of each env's discounted return and clipped
    # to +-reward_clip before returns and advantages are computed (SB3's VecNormalize norm_reward,
    # gymnasium's NormalizeReward). The learner keeps the statistics (in its checkpoints) and each
    # env's running return across fragments; the episode returns kuberl reports stay unscaled. On by
    # default, as Sample Factory's normalize_returns: bench/zoo.py measured CartPole 92.2k/67.6k env
    # steps to 475 without it and 63.5k/60.5k with it, Acrobot 45.9k/38.9k and 24.1k/18.3k to -100.
    normalize_rewards: bool = True
    reward_clip: float = 10.0
    # Linear annealing (CleanRL's anneal_lr, rl-baselines3-zoo's "lin_" schedules): the learning rate,
    # and the clip range where anneal_clip is set, fall linearly from their values above to 0 over
    # this many updates (batches; the learner's version), and stay at 0 after. None: constant.
    anneal_updates: int | None = None
    anneal_clip: bool = False

    def __post_init__(self):
        _require(self.reward_scale > 0, "reward_scale", self.reward_scale, "must be > 0")
        _require(self.obs_clip > 0, "obs_clip", self.obs_clip, "must be > 0")
        _require(self.reward_clip > 0, "reward_clip", self.reward_clip, "must be > 0")
        _require(self.max_policy_lag is None or self.max_policy_lag >= 0, "max_policy_lag", self.max_policy_lag,
                 "must be >= 0 (0 = train only on fragments from the current policy), or null for no bound")
        _require(self.stale_fragments in ("drop", "correct"), "stale_fragments", self.stale_fragments,
                 "must be 'drop' or 'correct'")
        _require(self.vtrace_rho_bar > 0 and self.vtrace_c_bar > 0, "vtrace_rho_bar",
                 (self.vtrace_rho_bar, self.vtrace_c_bar), "V-trace truncation levels must be > 0")
        _require(1 <= self.rollout_steps <= 65536, "rollout_steps", self.rollout_steps, "must be 1..65536")
        _require(self.batch_steps >= 1, "batch_steps", self.batch_steps, "must be >= 1")
        _require(self.num_epochs >= 1, "num_epochs", self.num_epochs, "must be >= 1")
        _require(self.anneal_updates is None or self.anneal_updates >= 1, "anneal_updates", self.anneal_updates,
                 "must be >= 1 (updates to anneal over), or null for constant rates")
        _require(not self.anneal_clip or self.anneal_updates is not None, "anneal_clip", self.anneal_clip,
                 "needs anneal_updates (the updates to anneal the clip range over)")
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
    # rl-baselines3-zoo's Acrobot and LunarLander settings (one update of 128 per env step, 256x256,
    # 6.3e-4): bench/zoo.py measured Acrobot at 30.5k env steps to -100 against SB3's 38.1k, where the
    # earlier defaults (a ratio of 8, 128x128, 1e-3) had not reached it in 100k (docs/benchmarks.md).
    learning_rate: float = 6.3e-4
    gamma: float = 0.99
    target_update_interval: int = 250  # updates between target-network syncs
    tau: float = 1.0                  # 1.0 = hard copy
    learning_starts: int = 1000       # transitions stored before the buffer serves batches
    # N-step returns (services/buffer/replay.py): each transition sums up to n_step rewards and
    # bootstraps from the observation n_step steps on, within a fragment and an episode.
    n_step: int = 3
    # Target replay ratio: transitions trained on per transition inserted after learning_starts. The
    # buffer's rate limiter (docs/rate-limiter.md) holds back batches from a learner that runs ahead of
    # production, and holds actors (and simulators' replies) that run ahead of the learner. 0 = unpaced.
    replay_ratio: float = 128.0
    replay_ratio_tolerance: float = 0.1  # the band is target * (1 +- tolerance)
    start_epsilon: float = 1.0
    end_epsilon: float = 0.05
    exploration_steps: int = 10_000   # env steps (per actor) to anneal epsilon over
    double_dqn: bool = True
    max_grad_norm: float = 10.0
    hidden_sizes: tuple[int, ...] = (256, 256)

    def __post_init__(self):
        _require(1 <= self.rollout_steps <= 65536, "rollout_steps", self.rollout_steps, "must be 1..65536")
        _require(self.learning_rate > 0, "learning_rate", self.learning_rate, "must be > 0")
        _require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        _require(self.target_update_interval >= 1, "target_update_interval", self.target_update_interval,
                 "must be >= 1")
        _require(0 < self.tau <= 1, "tau", self.tau, "must be in (0, 1]")
        _require(1 <= self.n_step <= self.rollout_steps, "n_step", self.n_step,
                 f"must be 1..rollout_steps ({self.rollout_steps}): returns are summed within a fragment")
        _check_replay(self)
        for name in ("start_epsilon", "end_epsilon"):
            _require(0 <= getattr(self, name) <= 1, name, getattr(self, name), "must be in [0, 1]")
        _require(self.exploration_steps >= 1, "exploration_steps", self.exploration_steps, "must be >= 1")
        _require(self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "must be > 0")
        _require(all(h > 0 for h in self.hidden_sizes), "hidden_sizes", self.hidden_sizes,
                 "every layer needs a positive width")


def _check_replay(section) -> None:
    """The replay settings DQN and SAC share: batch, capacity, warm-up and the pacing ratio."""
    _require(section.batch_size >= 1, "batch_size", section.batch_size, "must be >= 1")
    _require(section.buffer_size >= section.batch_size, "buffer_size", section.buffer_size,
             f"must hold at least one batch ({section.batch_size})")
    _require(section.batch_size <= section.learning_starts <= section.buffer_size, "learning_starts",
             section.learning_starts, f"must be between batch_size ({section.batch_size}) and buffer_size "
                                      f"({section.buffer_size}), or the first batch could never be cut")
    _require(section.replay_ratio >= 0, "replay_ratio", section.replay_ratio, "must be >= 0 (0 = unpaced)")
    _require(0 < section.replay_ratio_tolerance < 1, "replay_ratio_tolerance", section.replay_ratio_tolerance,
             "must be in (0, 1)")


@dataclass(frozen=True)
class SACConfig:
    """Soft actor-critic (Haarnoja et al. 2018, "Soft Actor-Critic Algorithms and Applications"): twin
    Q-networks with Polyak-averaged targets, a tanh-squashed Gaussian policy, automatic entropy
    tuning; uniform replay in the buffer, paced at `replay_ratio` as DQN's is. Defaults after CleanRL's
    sac_continuous_action.py (one update of 256 per env step: a replay ratio of 256), with a shorter
    warm-up (bench/zoo.py: 5000 random steps took Pendulum 1.70x SB3's env steps to -200, 1000 took 0.97x)."""
    rollout_steps: int = 8            # T: steps per env in one fragment
    buffer_size: int = 1_000_000      # replay capacity in transitions
    batch_size: int = 256             # transitions per update
    learning_starts: int = 1000       # transitions stored before the buffer serves batches; until the
                                      # learner's first update actors act uniformly at random
    replay_ratio: float = 256.0       # transitions trained on per transition inserted (0 = unpaced)
    replay_ratio_tolerance: float = 0.1
    gamma: float = 0.99
    tau: float = 0.005                # Polyak step of the target critics after every update
    policy_lr: float = 3e-4
    q_lr: float = 1e-3
    alpha: float = 0.2                # entropy temperature: the initial value when autotune is on
    autotune: bool = True             # learn alpha towards target_entropy
    target_entropy: float | None = None  # None: -(action dimensions), the paper's heuristic
    hidden_sizes: tuple[int, ...] = (256, 256)

    def __post_init__(self):
        _require(1 <= self.rollout_steps <= 65536, "rollout_steps", self.rollout_steps, "must be 1..65536")
        _check_replay(self)
        _require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        _require(0 < self.tau <= 1, "tau", self.tau, "must be in (0, 1]")
        for name in ("policy_lr", "q_lr", "alpha"):
            _require(math.isfinite(getattr(self, name)) and getattr(self, name) > 0, name, getattr(self, name),
                     "must be a finite number > 0")
        _require(self.target_entropy is None or math.isfinite(self.target_entropy), "target_entropy",
                 self.target_entropy, "must be a finite number, or left out for -(action dimensions)")
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
        _require(1 <= self.learners <= 64, "learners", self.learners,
                 "must be 1..64 (more than one train as a group, averaging gradients)")
        _require(self.buffers == 1, "buffers", self.buffers,
                 "only one buffer per experiment is supported so far (no sharding yet)")


@dataclass(frozen=True)
class ActorConfig:
    """Actor process settings."""
    # The send queue, bounded in fragments and in bytes: at either bound the oldest unsent fragment is
    # dropped (and counted). Both also bound what one push stream has in flight unacknowledged. Sized
    # to ride out a second or more of a stalled stream: 1,024 tiny CartPole fragments are about 1 MB,
    # while 64 MB holds about 60 Atari fragments of 32 steps x 8 envs.
    queue_fragments: int = 1024
    queue_mb: float = 64.0
    push_ack_interval_s: float = 2.0  # a push stream is half-closed and acknowledged this often
    torch_threads: int = 1
    # A user's cap on env steps per second (all of this actor's envs together); 0 = none. Not needed
    # for balance: the buffer's rate limiter holds an actor that outruns the learner (docs/rate-limiter.md).
    max_env_steps_per_s: float = 0.0
    # On-policy pacing (FIFO algorithms such as PPO): after cutting this many fragments with one policy
    # version (external mode: all sessions together), wait for the learner's next weights before
    # stepping on, or answering simulators (at most pace_timeout_s, then a fresh quota, counted).
    # Holds an actor that steps faster than the learner trains to what the learner consumes, as a
    # synchronous PPO does, instead of the FIFO evicting what it stepped (and the stepping taking the
    # learner's CPU). The fragments must hold a learner batch. 0 = never wait.
    fragments_per_version: int = 0
    pace_timeout_s: float = 10.0
    # External simulators (env.mode: external):
    max_sessions: int = 256            # concurrent EnvSession streams; more get RESOURCE_EXHAUSTED
    session_timeout_s: float = 30.0    # a session silent this long is closed (DEADLINE_EXCEEDED)
    session_resume_s: float = 300.0    # a session_id reconnecting within this resumes its episodes
    # Observations and rewards holding NaN or infinity are always refused (services/actor/finite.py).
    # True: observations outside the finite bounds of their space are refused too: a local env's
    # observation_space, a simulator's hello (its BoxSpace low/high, or each Dict key's).
    check_obs_bounds: bool = False

    def __post_init__(self):
        _require(self.max_sessions >= 1, "max_sessions", self.max_sessions, "must be >= 1")
        _require(self.session_timeout_s > 0, "session_timeout_s", self.session_timeout_s, "must be > 0")
        _require(self.session_resume_s >= 0, "session_resume_s", self.session_resume_s, "must be >= 0")
        _require(self.max_env_steps_per_s >= 0, "max_env_steps_per_s", self.max_env_steps_per_s, "must be >= 0")
        _require(self.fragments_per_version >= 0, "fragments_per_version", self.fragments_per_version, "must be >= 0")
        _require(self.pace_timeout_s > 0, "pace_timeout_s", self.pace_timeout_s, "must be > 0")
        _require(1 <= self.queue_fragments <= DEDUPE_WINDOW, "queue_fragments", self.queue_fragments,
                 f"must be 1..{DEDUPE_WINDOW}: a buffer dedupes a re-sent fragment exactly only within the last "
                 f"{DEDUPE_WINDOW} seqs of its sender (services/common/fragments.py)")
        _require(self.queue_mb > 0, "queue_mb", self.queue_mb, "must be > 0")
        _require(self.push_ack_interval_s > 0, "push_ack_interval_s", self.push_ack_interval_s, "must be > 0")
        _require(self.torch_threads >= 1, "torch_threads", self.torch_threads, "must be >= 1")


@dataclass(frozen=True)
class BufferConfig:
    """Buffer process settings."""
    max_message_mb: int = 64          # largest fragment accepted / batch sent, MiB
    fifo_capacity_steps: int = 8192   # PPO: steps held before the oldest fragment is evicted (counted)
    # Batches a learner holds queued beside the one it trains on; the buffer serves a learner that
    # reports its progress no more than this many batches beyond the one it trains on.
    batch_prefetch: int = 2
    # DQN: where the replay ring (with its dedupe windows and counters) is checkpointed, periodically
    # and at shutdown, and restored from at start, so a restarted buffer keeps its experience.
    # None = off. `kuberl buffer --checkpoint-dir` overrides it. PPO's FIFO is never checkpointed.
    # Costs: docs/reliability.md, "Buffer checkpoints".
    checkpoint_dir: str | None = None
    checkpoint_interval_s: float = 300.0  # between replay checkpoints; one is also written at shutdown
    keep_checkpoints: int = 2         # newest replay checkpoints kept; an unreadable newest falls back
    # DQN: how the replay ring keeps stacked frames (docs/architecture.md section 2, "Replay storage").
    # "auto": each frame once when the first fragment's observations are uint8 frame stacks that
    # move on by one frame a step (Atari: ~7.4 KB a transition instead of 56 KB), else obs and next_obs
    # as they came; "always": frames once for any observation with a stack axis; "never": as they came.
    # A checkpoint restores in the layout it was saved in; "always"/"never" refuse one of the other.
    compact_replay: str = "auto"

    def __post_init__(self):
        _require(1 <= self.max_message_mb <= 1024, "max_message_mb", self.max_message_mb, "must be 1..1024")
        _require(self.compact_replay in ("auto", "always", "never"), "compact_replay", self.compact_replay,
                 "must be 'auto' (frames stored once for stacked uint8 frames), 'always' or 'never'")
        _require(self.fifo_capacity_steps >= 1, "fifo_capacity_steps", self.fifo_capacity_steps, "must be >= 1")
        _require(self.batch_prefetch >= 1, "batch_prefetch", self.batch_prefetch, "must be >= 1")
        _require(self.checkpoint_dir is None or self.checkpoint_dir.strip() != "", "checkpoint_dir",
                 self.checkpoint_dir, "must be a directory path, or left out (null) to keep the replay in memory "
                 "only (a restarted buffer then starts empty)")
        _require(self.checkpoint_interval_s >= 1, "checkpoint_interval_s", self.checkpoint_interval_s,
                 "must be >= 1 second: each replay checkpoint copies and writes the whole ring")
        _require(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints,
                 "must be >= 1 (2 or more lets a restart fall back when the newest cannot be read)")


@dataclass(frozen=True)
class LearnerConfig:
    """Learner process settings."""
    publish_interval_updates: int = 1  # K: publish weights every K updates
    checkpoint_interval_s: float = 60.0  # T: also checkpoint on shutdown
    keep_checkpoints: int = 3
    torch_threads: int = 1
    device: str = "cpu"               # cpu | cuda | cuda:N | auto (cuda when torch sees a GPU, else cpu)

    def __post_init__(self):
        _require(self.publish_interval_updates >= 1, "publish_interval_updates",
                 self.publish_interval_updates, "must be >= 1")
        _require(self.checkpoint_interval_s > 0, "checkpoint_interval_s", self.checkpoint_interval_s, "must be > 0")
        _require(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints, "must be >= 1")
        _require(self.torch_threads >= 1, "torch_threads", self.torch_threads, "must be >= 1")
        _require(self.device in ("cpu", "auto") or re.fullmatch(r"cuda(:\d+)?", self.device) is not None,
                 "device", self.device, "must be 'cpu', 'cuda', 'cuda:N' or 'auto' (cuda when available)")


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
class EvalConfig:
    """How a trained policy is evaluated (docs/after-training.md): its deterministic actions (argmax,
    the Gaussian's mean) over whole episodes on env copies of their own, by `kuberl eval` and, on the
    final checkpoint, by `kuberl up` when training ends (into summary.json). Each copy runs a fixed
    share of the episodes, so short episodes are not over-represented (SB3's evaluate_policy)."""
    episodes: int = 10                # episodes per evaluation (`kuberl eval --episodes` overrides)
    num_envs: int = 5                 # env copies stepped in parallel (at most `episodes` are used)
    seed: int = 1_000_000             # copy i is seeded seed + i: apart from the actors' env.seed + 1000 * i
    after_training: bool = True       # `kuberl up` evaluates the final checkpoint; false: it does not
    max_seconds: float = 120.0        # `kuberl up`'s evaluation stops after this long and reports the
    #                                   episodes finished by then (0 = no limit); `kuberl eval` has none

    def __post_init__(self):
        _require(self.episodes >= 1, "episodes", self.episodes, "must be >= 1")
        _require(self.num_envs >= 1, "num_envs", self.num_envs, "must be >= 1")
        _require(self.seed >= 0, "seed", self.seed, "must be >= 0 (gymnasium seeds are non-negative)")
        _require(math.isfinite(self.max_seconds) and self.max_seconds >= 0, "max_seconds", self.max_seconds,
                 "must be >= 0 (0 = no limit)")


@dataclass(frozen=True)
class RolePlanConfig:
    """The planner's bounds and step sizes for one scalable role (actor or learner)."""
    min: int = 1
    max: int = 8
    cost: float = 1.0          # budget units one replica uses (cores locally, pods or cores in a cluster)
    max_step_up: int = 2       # most replicas added by one decision
    max_step_down: int = 1     # most replicas removed by one decision

    def __post_init__(self):
        _require(self.min >= 0, "min", self.min, "must be >= 0")
        _require(self.max >= max(self.min, 1), "max", self.max, f"must be >= min ({self.min}) and >= 1")
        _require(self.cost > 0, "cost", self.cost, "must be > 0")
        _require(self.max_step_up >= 1, "max_step_up", self.max_step_up, "must be >= 1")
        _require(self.max_step_down >= 1, "max_step_down", self.max_step_down, "must be >= 1")


@dataclass(frozen=True)
class KubernetesPlannerConfig:
    """Where the planner's Kubernetes backend finds and scales the roles (all in one namespace)."""
    # Keys of older configs that are gone, and what to write instead (see _build).
    _replaced: typing.ClassVar[dict[str, str]] = {
        "learner_deployment": "replaced by planner.kubernetes.learner_statefulset: the learners are a StatefulSet "
                              "now (pod ordinal = rank in the group); rename the key (its value names the "
                              "learner StatefulSet, default kuberl-learner)"}
    namespace: str = ""                     # "" = the pod's own namespace in a cluster, else the kubeconfig's
    actor_deployment: str = "kuberl-actor"  # the actors: a Deployment
    learner_statefulset: str = "kuberl-learner"  # the learners: a StatefulSet (pod ordinal = rank in the group)
    actor_service: str = "kuberl-actor"     # headless Services whose Endpoints list the replicas
    learner_service: str = "kuberl-learner"
    buffer_service: str = "kuberl-buffer"
    grpc_port_name: str = "grpc"            # the Service port the planner reads GetStats on
    field_manager: str = "kuberl-planner"
    pause_annotation: str = "kuberl.io/planner-paused"  # "true" on the Deployment or StatefulSet: left alone
    leader_election: bool = True            # one active planner per namespace (a coordination.k8s.io Lease)
    lease_name: str = "kuberl-planner"
    lease_duration_s: float = 15.0
    qps: float = 5.0                        # client-side rate limit on API writes and reads
    burst: int = 10

    def __post_init__(self):
        _require(self.qps > 0, "qps", self.qps, "must be > 0")
        _require(self.burst >= 1, "burst", self.burst, "must be >= 1")
        _require(self.lease_duration_s >= 2, "lease_duration_s", self.lease_duration_s, "must be >= 2")
        _require(bool(self.field_manager), "field_manager", self.field_manager, "must not be empty")


@dataclass(frozen=True)
class PlannerConfig:
    """The planner: how it measures, when it acts and within which bounds (see docs/planner.md)."""
    enabled: bool = True            # `kuberl up` runs the planner; false keeps topology.actors fixed
    backend: str = "local"          # "local" (processes), "kubernetes" (workloads' scale) or "dry-run" (decide only)
    interval_s: float = 5.0         # one decision this often
    tolerance: float = 0.15         # act only when production/consumption is outside 1 +- tolerance
    budget: float = 0.0             # total cost of actors + learners; 0 = only the per-role max bounds
    # What a replica costs against the budget: "configured" (planner.<role>.cost) or "measured" (the CPU
    # cores its process was measured to use, EWMA after warm-up; the configured cost until then).
    costs: str = "configured"
    rate_halflife_s: float = 10.0   # EWMA half-life of the per-replica rates
    warmup_s: float = 10.0          # a replica's rates count only after it has reported this long
    cooldown_s: float = 20.0        # no change within this long of the last one (must exceed warmup_s)
    scale_down_window_s: float = 60.0  # scale down only to the largest target seen over this window
    stale_after_s: float = 15.0     # metrics older than this are stale: no scale-down on them
    converge_timeout_s: float = 120.0  # a change not converged by then is reported and no longer blocks
    drain_timeout_s: float = 30.0   # local backend: an actor stopped by a scale-down gets this long to flush
    # Staleness target: no actor scale-up while the learners' recent mean policy lag (learner version -
    # sample's policy_version, `learner/policy_lag_mean`) exceeds this many versions; 0 = no target.
    max_policy_lag: float = 0.0
    # Saturation: once a scale-up has converged, the role's measured total rate must have risen by at
    # least this share of what the balance model predicted; else the planner caps the role at the count
    # that paid, for saturation_hold_s (replicas sharing cores or another bottleneck). 0 = not checked.
    min_scale_gain: float = 0.5
    saturation_hold_s: float = 300.0
    actor: RolePlanConfig = field(default_factory=lambda: RolePlanConfig(min=1, max=8))
    # More than one learner: they train as a group (gradients averaged), re-formed from the latest checkpoint
    # whenever the planner changes its size (local backend: it restarts the group; kubernetes: the learners
    # watch their StatefulSet's scale and re-form in their processes).
    learner: RolePlanConfig = field(default_factory=lambda: RolePlanConfig(min=1, max=1))
    kubernetes: KubernetesPlannerConfig = field(default_factory=KubernetesPlannerConfig)

    def __post_init__(self):
        _require(self.backend in ("local", "kubernetes", "dry-run"), "backend", self.backend,
                 "must be 'local', 'kubernetes' or 'dry-run'")
        _require(self.interval_s > 0, "interval_s", self.interval_s, "must be > 0")
        _require(self.costs in ("configured", "measured"), "costs", self.costs, "must be 'configured' or 'measured'")
        _require(0 < self.tolerance < 1, "tolerance", self.tolerance, "must be in (0, 1)")
        _require(self.budget >= 0, "budget", self.budget, "must be >= 0 (0 = no budget)")
        _require(self.rate_halflife_s > 0, "rate_halflife_s", self.rate_halflife_s, "must be > 0")
        _require(self.warmup_s >= 0, "warmup_s", self.warmup_s, "must be >= 0")
        _require(self.cooldown_s > self.warmup_s, "cooldown_s", self.cooldown_s,
                 f"must be longer than warmup_s ({self.warmup_s}): a change is judged only on warmed-up replicas")
        _require(self.scale_down_window_s >= 0, "scale_down_window_s", self.scale_down_window_s, "must be >= 0")
        _require(self.stale_after_s > 0, "stale_after_s", self.stale_after_s, "must be > 0")
        _require(self.converge_timeout_s > 0, "converge_timeout_s", self.converge_timeout_s, "must be > 0")
        _require(self.drain_timeout_s > 0, "drain_timeout_s", self.drain_timeout_s, "must be > 0")
        _require(0 <= self.min_scale_gain <= 1, "min_scale_gain", self.min_scale_gain,
                 "must be in [0, 1] (0 = scale-ups are not checked)")
        _require(self.saturation_hold_s > 0, "saturation_hold_s", self.saturation_hold_s, "must be > 0")
        _require(self.max_policy_lag >= 0, "max_policy_lag", self.max_policy_lag, "must be >= 0 (0 = no staleness target)")
        _require(self.budget == 0 or self.budget >= self.actor.min * self.actor.cost + self.learner.min * self.learner.cost,
                 "budget", self.budget, "cannot fit the minimum replicas of every role")


@dataclass(frozen=True)
class TlsConfig:
    """TLS on every gRPC endpoint, from PEM files (a mounted Secret; see docs/security.md). Each process's
    --tls-cert/--tls-key/--tls-ca/--tls-client-auth/--tls-server-name flags override these
    (services/common/runtime.with_tls_flags); the files are checked when a role starts."""
    enabled: bool = False
    cert_file: str = ""        # this process's certificate chain: served, and presented when dialling other roles
    key_file: str = ""         # cert_file's private key (unencrypted)
    ca_file: str = ""          # the CA bundle that verifies peers: servers dialled, and clients under client_auth: require
    client_auth: str = "require"  # "require": servers accept only clients with a certificate from ca_file (mTLS);
    #                               "none": server-side TLS only (e.g. an actor whose simulators have no certificate)
    server_name: str = ""      # the name checked in servers' certificates ("" = the host dialled)
    # Authorisation per role of the roles' internal RPCs: the certificate names (DNS names of its
    # subjectAltName, or its CN) that prove a client is an actor or a learner. Set, the buffer serves
    # PushTrajectories/WatchInsertLimit only to actors and StreamBatches/ReportProgress only to learners, and a learner
    # SubscribeWeights only to actors (services/common/auth.ROLE_RPCS); empty: any certificate from ca_file.
    role_names: dict[str, tuple[str, ...]] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        _require(self.client_auth in ("require", "none"), "client_auth", self.client_auth,
                 "must be 'require' (servers verify client certificates: mutual TLS) or 'none'")
        if self.role_names:
            _require(set(self.role_names) == set(PEER_ROLES), "role_names", dict(self.role_names),
                     f"must name the certificates of exactly these roles, the callers of the internal RPCs: "
                     f"{', '.join(PEER_ROLES)}")
            for role, names in self.role_names.items():
                _require(bool(names) and all(isinstance(n, str) and n.strip() for n in names),
                         f"role_names.{role}", names, "must be a list of certificate names (DNS names or CN)")


PEER_ROLES = ("actor", "learner")  # the roles whose certificates tls.role_names names


def parse_role_names(text: str, setting: str = "--tls-role-names") -> dict[str, tuple[str, ...]]:
    """`actor=kuberl-actor,learner=kuberl-learner` (several names of a role joined by `|`) as a
    `tls.role_names` mapping; ConfigError naming `setting` when malformed."""
    out: dict[str, tuple[str, ...]] = {}
    for part in (p.strip() for p in text.split(",")):
        role, eq, names = part.partition("=")
        role = role.strip()
        if not part or not eq or role in out:
            raise ConfigError(setting, f"{text!r} is invalid: write ROLE=NAME[|NAME...] for each of "
                                       f"{', '.join(PEER_ROLES)}, separated by commas")
        out[role] = tuple(n.strip() for n in names.split("|") if n.strip())
    return out


@dataclass(frozen=True)
class AuthConfig:
    """Bearer tokens on the RPCs people and simulators call, and caps on EnvSession sessions
    (services/common/auth.py, docs/security.md). No token files: those RPCs stay open, as before."""
    token_files: tuple[str, ...] = ()  # files of accepted tokens, one per line
    #                               ("TOKEN" or "TOKEN scope1,scope2"; scopes envsession, planner:write, read;
    #                               none = all); re-read when they change, so tokens rotate without a restart
    protect_reads: bool = False     # GetStats and the planner's read-only RPCs also need a token (scope read)
    client_token_file: str = ""     # the token this role sends when it calls others (the planner's GetStats reads)
    max_sessions_per_token: int = 0     # EnvSession sessions open at once per token (per peer host without
    #                                     tokens); 0 = unlimited
    new_sessions_per_minute: float = 0  # new EnvSession sessions a minute per token (a token bucket); 0 = unlimited

    def __post_init__(self):
        for i, path in enumerate(self.token_files):
            _require(isinstance(path, str) and bool(path.strip()), f"token_files[{i}]", path,
                     "must be a file path")
        _require(self.max_sessions_per_token >= 0, "max_sessions_per_token", self.max_sessions_per_token,
                 "must be >= 0 (0 = unlimited)")
        _require(math.isfinite(self.new_sessions_per_minute) and self.new_sessions_per_minute >= 0,
                 "new_sessions_per_minute", self.new_sessions_per_minute, "must be >= 0 (0 = unlimited)")


@dataclass(frozen=True)
class ExperimentConfig:
    """The whole experiment. `algorithm` names the one of services/algorithms that trains, and the
    section of its settings (`ppo`, `dqn`, `sac`)."""
    algorithm: str = "ppo"
    seed: int = 0
    env: EnvConfig = field(default_factory=EnvConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    dqn: DQNConfig = field(default_factory=DQNConfig)
    sac: SACConfig = field(default_factory=SACConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)

    def __post_init__(self):
        _require(self.algorithm in algorithms.REGISTRY, "algorithm", self.algorithm,
                 f"must be one of {', '.join(sorted(algorithms.REGISTRY))}")
        # Declared spaces (env.mode: external) are checked against the algorithm here, so no process
        # starts to crash on them; an env id's are checked by `kuberl up` (envs.checked_spec), which makes it.
        if (declared := self.env.declared_spec) is not None:
            check_algorithm_takes(self, declared, *self.env.declared_sources)
        _require(self.planner.actor.min <= self.topology.actors <= self.planner.actor.max, "topology.actors",
                 self.topology.actors, f"must lie within planner.actor.min..max "
                 f"({self.planner.actor.min}..{self.planner.actor.max}), the planner's bounds")
        learner = self.planner.learner
        _require(not self.planner.enabled or learner.min <= self.topology.learners <= learner.max,
                 "topology.learners", self.topology.learners,
                 f"must lie within planner.learner.min..max ({learner.min}..{learner.max}), the planner's bounds")
        pace = self.actor.fragments_per_version
        if pace:
            algorithm = algorithms.get(self.algorithm)
            _require(isinstance(algorithm.table(self), algorithms.FifoTable), "actor.fragments_per_version", pace,
                     f"paces on-policy algorithms; {self.algorithm}'s learner is paced by its replay ratio")
            samples = pace * self.rollout_steps * self.env.num_envs
            # (External sessions' fragments are rollout_steps x each session's num_envs: unknown here.)
            _require(self.env.mode == "external" or samples >= algorithm.batch_size(self),
                     "actor.fragments_per_version", pace,
                     f"{pace} fragments of {self.rollout_steps} x {self.env.num_envs} steps = {samples} samples "
                     f"per version, fewer than the learner's batch of {algorithm.batch_size(self)}: a lone actor "
                     f"would wait for weights that need more of its samples")

    @property
    def rollout_steps(self) -> int:
        """Steps per fragment, from the algorithm's section (every section has one)."""
        return getattr(self, self.algorithm).rollout_steps

    @property
    def hidden_sizes(self) -> tuple[int, ...]:
        return getattr(self, self.algorithm).hidden_sizes

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
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"must be a mapping, got {type(value).__name__} {value!r}")
        key_type, value_type = typing.get_args(tp)
        return {_convert(key_type, k, key): _convert(value_type, v, f"{key}.{k}") for k, v in value.items()}
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
    replaced = getattr(cls, "_replaced", {})
    for k in data:
        if k in replaced:
            raise ConfigError(f"{prefix}{k}", f"no longer a key: {replaced[k]}")
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

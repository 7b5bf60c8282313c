"""The sections of the experiment config that every role reads: env, topology, each role's process
settings, the planner, TLS and tokens (one frozen dataclass per concern, checked as it is built).

The experiment config itself, with the section of each algorithm (services/algorithms/<name>/config.py),
is services/config.py; this module knows no algorithm. `CommonConfig` holds these sections; code in
services/common takes it, and the whole ExperimentConfig is one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from services.common.protocol import spaces
from services.common.protocol.fragments import DEDUPE_WINDOW
from services.common.settings import ConfigError, require
from services.common.net.shards import MAX_SHARDS
from services.common.net.auth import AuthConfig
from services.common.net.policy import DEFAULT as DEFAULT_POLICY, name_problem
from services.common.net.tls import TlsConfig


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

    def __post_init__(self) -> None:
        require(self.backend in ("ale_vector", "gymnasium"), "backend", self.backend,
                "must be 'ale_vector' or 'gymnasium'")
        require(1 <= self.frame_stack <= 16, "frame_stack", self.frame_stack, "must be 1..16")
        require(1 <= self.frameskip <= 16, "frameskip", self.frameskip, "must be 1..16")
        require(16 <= self.screen_size <= 256, "screen_size", self.screen_size, "must be 16..256")
        require(0 <= self.noop_max <= 1000, "noop_max", self.noop_max, "must be 0..1000")
        require(0.0 <= self.repeat_action_probability < 1.0, "repeat_action_probability",
                self.repeat_action_probability, "must be in [0, 1)")
        require(0 <= self.threads <= 256, "threads", self.threads, "must be 0..256 (0 = one per core)")


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

    def __post_init__(self) -> None:
        kinds = {"discrete": ("n",), "multi_discrete": ("nvec",), "box": ("shape", "low", "high")}
        require(self.type in kinds, "type", self.type, "must be discrete, multi_discrete or box")
        for name in ("n", "nvec", "shape", "low", "high"):
            require(getattr(self, name) is None or name in kinds[self.type], name, getattr(self, name),
                    f"is not a setting of a {self.type} space (it takes {', '.join(kinds[self.type])})")
        require(self.type != "discrete" or (self.n is not None and self.n >= 1), "n", self.n,
                "a discrete space needs n >= 1")
        require(self.type != "multi_discrete" or bool(self.nvec), "nvec", self.nvec,
                "a multi_discrete space needs nvec, one count per choice")
        require(self.type != "box" or bool(self.shape), "shape", self.shape, "a box space needs a shape")
        try:
            self.space()
        except ValueError as err:
            raise ConfigError("nvec" if self.type == "multi_discrete" else "shape", str(err)) from None

    def space(self) -> spaces.ActionSpace:
        """The space as services.common.protocol.spaces has it (ValueError if it cannot be one)."""
        # (__post_init__ has required the type's own settings before it calls this)
        if self.type == "discrete":
            assert self.n is not None
            return spaces.Discrete(self.n)
        if self.type == "multi_discrete":
            assert self.nvec is not None
            return spaces.checked(spaces.MultiDiscrete(tuple(self.nvec)))
        assert self.shape is not None
        inf = float("inf")
        return spaces.checked(spaces.Box.of(self.shape, self.low if self.low else -inf,
                                            self.high if self.high else inf))


@dataclass(frozen=True, kw_only=True)
class DeclaredSpaces:
    """Spaces declared in the config, for external simulators not in gymnasium (`env.*`, and each of
    several policies' own, `policies.<name>.*`): an observation Box (observation_shape and
    observation_dtype) or Dict (observation_keys: each key's shape; flattened into float32, keys
    sorted), and the action space (action_space, or num_actions as shorthand for a Discrete one)."""
    observation_shape: tuple[int, ...] | None = None
    observation_dtype: str = "float32"
    observation_keys: dict[str, tuple[int, ...]] | None = None
    num_actions: int | None = None
    action_space: ActionSpaceConfig | None = None

    @property
    def declares(self) -> bool:
        return self.observation_shape is not None or self.observation_keys is not None

    def _check_declared(self) -> None:
        require(self.num_actions is None or self.action_space is None, "num_actions", self.num_actions,
                "give num_actions (a Discrete space) or action_space, not both")
        require(self.observation_shape is None or self.observation_keys is None, "observation_keys",
                self.observation_keys, "give observation_shape (a Box) or observation_keys (a Dict), not both")
        declared_obs = self.observation_shape is not None or self.observation_keys is not None
        declared_act = self.num_actions is not None or self.action_space is not None
        require(declared_obs == declared_act, "observation_shape" if declared_act else "action_space",
                self.observation_shape if declared_act else self.action_space,
                "declare the observation space (observation_shape or observation_keys) and the action "
                "space (action_space or num_actions) together, or neither")
        require(self.observation_shape is None or all(d >= 1 for d in self.observation_shape),
                "observation_shape", self.observation_shape, "every dimension must be >= 1")
        for key, shape in (self.observation_keys or {}).items():
            require(0 < len(key) <= 64 and all(d >= 1 for d in shape), f"observation_keys.{key}", list(shape),
                    "keys of 1..64 characters, every dimension >= 1")
        require(self.observation_keys is None or 0 < len(self.observation_keys) <= 64, "observation_keys",
                self.observation_keys, "1..64 keys")
        if self.observation_keys is not None:
            try:
                spaces.dict_layout(self.observation_keys)
            except ValueError as err:
                raise ConfigError("observation_keys", str(err)) from None
        require(self.num_actions is None or self.num_actions >= 1, "num_actions", self.num_actions, "must be >= 1")
        require(self.observation_dtype in ("float32", "float64", "uint8", "int32", "int64"), "observation_dtype",
                self.observation_dtype, "must be float32, float64, uint8, int32 or int64")
        require(self.observation_keys is None or self.observation_dtype == "float32", "observation_dtype",
                self.observation_dtype, "a Dict observation is flattened into float32")

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
        assert self.observation_shape is not None   # declared with the action space (__post_init__)
        return spaces.EnvSpec(tuple(self.observation_shape), np.dtype(self.observation_dtype), action)

    def declared_sources(self, section: str) -> tuple[str, str]:
        """The keys under `section` (`env`, `policies.<name>`) that declare the action and observation
        spaces, as `Algorithm.check_spec` names them."""
        action = f"{section}.num_actions" if self.num_actions is not None else f"{section}.action_space"
        obs = (f"the declared observations ({section}.observation_keys)" if self.observation_keys is not None
               else f"the declared observations ({section}.observation_shape, {section}.observation_dtype)")
        return action, obs


@dataclass(frozen=True)
class EnvConfig(DeclaredSpaces):
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
    atari: AtariConfig = field(default_factory=AtariConfig)  # used when `id` is ALE/<Game>-v5
    # Keyword arguments for the env's constructor: gymnasium.make's, or a PettingZoo module's
    # parallel_env()/env() (e.g. {N: 3, max_cycles: 25, continuous_actions: false} for simple_spread).
    kwargs: dict[str, int | float | str | bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(not is_atari(self.id) or re.fullmatch(r"ALE/[A-Za-z0-9]+-v5", self.id) is not None, "id",
                self.id, "Atari ids are ALE/<Game>-v5, e.g. ALE/Pong-v5")
        require(self.mode in ("local", "external"), "mode", self.mode, "must be 'local' or 'external'")
        require(not self.id.startswith("pettingzoo:") or self.mode == "local", "mode", self.mode,
                "PettingZoo envs are local envs (a simulator of several agents connects over EnvSession with "
                "env.mode: external and a gymnasium id or declared spaces)")
        require(not self.id.startswith("pettingzoo:") or self.max_episode_steps is None, "max_episode_steps",
                self.max_episode_steps, "PettingZoo envs take their own limit in env.kwargs (e.g. max_cycles)")
        require(not self.id.startswith("pettingzoo:") or re.fullmatch(r"pettingzoo:[A-Za-z_][\w.]*", self.id)
                is not None, "id", self.id, "PettingZoo ids are pettingzoo:<module>, e.g. pettingzoo:mpe2.simple_spread_v3")
        self._check_declared()
        require(not self.declares or self.mode == "external", "observation_shape", self.observation_shape,
                "declared spaces are for env.mode: external; local envs have their own")
        require(bool(self.id), "id", self.id, "an env id is required")
        require(1 <= self.num_envs <= 4096, "num_envs", self.num_envs, "must be 1..4096")
        require(self.max_episode_steps is None or self.max_episode_steps > 0, "max_episode_steps",
                self.max_episode_steps, "must be positive")


@dataclass(frozen=True)
class TopologyConfig:
    """How many processes of each role `kuberl up` starts."""
    actors: int = 1
    learners: int = 1
    # Buffer shards: each actor pushes to one, each learner streams from all; a replay's buffer_size
    # and learning_starts are split between them (docs/architecture.md, "Buffer shards").
    buffers: int = 1

    def __post_init__(self) -> None:
        require(1 <= self.actors <= 256, "actors", self.actors, "must be 1..256")
        require(1 <= self.learners <= 64, "learners", self.learners,
                "must be 1..64 (more than one train as a group, averaging gradients)")
        require(1 <= self.buffers <= MAX_SHARDS, "buffers", self.buffers,
                f"must be 1..{MAX_SHARDS} (buffer shards: each actor pushes to one, each learner streams from all)")


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

    def __post_init__(self) -> None:
        require(self.max_sessions >= 1, "max_sessions", self.max_sessions, "must be >= 1")
        require(self.session_timeout_s > 0, "session_timeout_s", self.session_timeout_s, "must be > 0")
        require(self.session_resume_s >= 0, "session_resume_s", self.session_resume_s, "must be >= 0")
        require(self.max_env_steps_per_s >= 0, "max_env_steps_per_s", self.max_env_steps_per_s, "must be >= 0")
        require(self.fragments_per_version >= 0, "fragments_per_version", self.fragments_per_version, "must be >= 0")
        require(self.pace_timeout_s > 0, "pace_timeout_s", self.pace_timeout_s, "must be > 0")
        require(1 <= self.queue_fragments <= DEDUPE_WINDOW, "queue_fragments", self.queue_fragments,
                f"must be 1..{DEDUPE_WINDOW}: a buffer dedupes a re-sent fragment exactly only within the last "
                f"{DEDUPE_WINDOW} seqs of its sender (services/common/protocol/fragments.py)")
        require(self.queue_mb > 0, "queue_mb", self.queue_mb, "must be > 0")
        require(self.push_ack_interval_s > 0, "push_ack_interval_s", self.push_ack_interval_s, "must be > 0")
        require(self.torch_threads >= 1, "torch_threads", self.torch_threads, "must be >= 1")


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
    # DQN, SAC: the replay's Store works on a thread of its own (services/buffer/owner.py), so the event
    # loop goes on reading pushes and writing batches meanwhile, and batch cuts pass queued inserts.
    # It shifts the GIL-bound work toward learners rather than adding to it: off by default
    # (docs/benchmarks.md, "Buffer event loop"). A FIFO (PPO) always works on the loop.
    store_thread: bool = False

    def __post_init__(self) -> None:
        require(1 <= self.max_message_mb <= 1024, "max_message_mb", self.max_message_mb, "must be 1..1024")
        require(self.compact_replay in ("auto", "always", "never"), "compact_replay", self.compact_replay,
                "must be 'auto' (frames stored once for stacked uint8 frames), 'always' or 'never'")
        require(self.fifo_capacity_steps >= 1, "fifo_capacity_steps", self.fifo_capacity_steps, "must be >= 1")
        require(self.batch_prefetch >= 1, "batch_prefetch", self.batch_prefetch, "must be >= 1")
        require(self.checkpoint_dir is None or self.checkpoint_dir.strip() != "", "checkpoint_dir",
                self.checkpoint_dir, "must be a directory path, or left out (null) to keep the replay in memory "
                "only (a restarted buffer then starts empty)")
        require(self.checkpoint_interval_s >= 1, "checkpoint_interval_s", self.checkpoint_interval_s,
                "must be >= 1 second: each replay checkpoint copies and writes the whole ring")
        require(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints,
                "must be >= 1 (2 or more lets a restart fall back when the newest cannot be read)")


@dataclass(frozen=True)
class LearnerConfig:
    """Learner process settings."""
    publish_interval_updates: int = 1  # K: publish weights every K updates
    checkpoint_interval_s: float = 60.0  # T: also checkpoint on shutdown
    keep_checkpoints: int = 3
    torch_threads: int = 1
    device: str = "cpu"               # cpu | cuda | cuda:N | auto (cuda when torch sees a GPU, else cpu)

    def __post_init__(self) -> None:
        require(self.publish_interval_updates >= 1, "publish_interval_updates",
                self.publish_interval_updates, "must be >= 1")
        require(self.checkpoint_interval_s > 0, "checkpoint_interval_s", self.checkpoint_interval_s, "must be > 0")
        require(self.keep_checkpoints >= 1, "keep_checkpoints", self.keep_checkpoints, "must be >= 1")
        require(self.torch_threads >= 1, "torch_threads", self.torch_threads, "must be >= 1")
        require(self.device in ("cpu", "auto") or re.fullmatch(r"cuda(:\d+)?", self.device) is not None,
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

    def __post_init__(self) -> None:
        require(self.return_window >= 1, "return_window", self.return_window, "must be >= 1")
        require(self.max_env_steps >= 1, "max_env_steps", self.max_env_steps, "must be >= 1")
        require(self.max_seconds is None or self.max_seconds > 0, "max_seconds", self.max_seconds, "must be > 0")
        require(self.poll_interval_s > 0, "poll_interval_s", self.poll_interval_s, "must be > 0")


WANDB_MODES = ("online", "offline")


@dataclass(frozen=True)
class WandbTracking:
    """Weights & Biases (docs/tracking.md): `kuberl up` logs the run there as it trains."""
    enabled: bool = False
    project: str = "kuberl"
    entity: str | None = None         # your team or user; default: W&B's default entity
    mode: str = "online"              # offline: written under the run directory, `wandb sync` later
    group: str | None = None
    tags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        require(self.mode in WANDB_MODES, "mode", self.mode, f"must be one of {', '.join(WANDB_MODES)}")
        require(bool(self.project), "project", self.project, "must not be empty")


@dataclass(frozen=True)
class MlflowTracking:
    """MLflow (docs/tracking.md): `kuberl up` logs the run to a tracking server or a local database."""
    enabled: bool = False
    tracking_uri: str | None = None   # default: $MLFLOW_TRACKING_URI, else sqlite:///<run.run_dir>/mlflow.db
    experiment: str = "kuberl"

    def __post_init__(self) -> None:
        require(bool(self.experiment), "experiment", self.experiment, "must not be empty")


@dataclass(frozen=True)
class TrackingConfig:
    """Experiment tracking sinks `kuberl up` feeds: the config, every progress scalar, episodes, the
    planner's decisions, the evaluation and, with `artifacts`, the final checkpoint and the policy
    exported to ONNX, and with `video` one episode of the final policy. A sink that fails is counted and
    logged once; it never stops training."""
    wandb: WandbTracking = field(default_factory=WandbTracking)
    mlflow: MlflowTracking = field(default_factory=MlflowTracking)
    artifacts: bool = True
    video: bool = True                # one episode of the final policy (deterministic), where the env renders


TUNE_TYPES = ("float", "int", "categorical")


@dataclass(frozen=True)
class TuneParam:
    """One hyper-parameter's range for `kuberl tune` (Optuna's suggest_float, suggest_int,
    suggest_categorical): `float` or `int` between `low` and `high` (log-uniform with `log`), or one of
    `choices`."""
    type: str = "float"
    low: float | None = None
    high: float | None = None
    log: bool = False
    choices: tuple[int | float | str | bool, ...] = ()

    def __post_init__(self) -> None:
        require(self.type in TUNE_TYPES, "type", self.type, f"must be one of {', '.join(TUNE_TYPES)}")
        if self.type == "categorical":
            require(len(self.choices) >= 2, "choices", list(self.choices), "a categorical needs two choices or more")
            require(self.low is None and self.high is None, "low", self.low, "a categorical takes choices, not a range")
            return
        require(not self.choices, "choices", list(self.choices), f"a {self.type} takes low and high, not choices")
        require(self.low is not None and self.high is not None and self.low < self.high, "low", self.low,
                f"needs low < high (high: {self.high})")
        require(not self.log or (self.low is not None and self.low > 0), "low", self.low, "log needs low > 0")
        if self.type == "int":
            require(float(self.low or 0).is_integer() and float(self.high or 0).is_integer(), "low", self.low,
                    f"an int range needs whole bounds (high: {self.high})")


TUNE_METRICS = ("return", "evaluation")
TUNE_PRUNERS = ("median", "none")
TUNE_SAMPLERS = ("tpe", "random")


@dataclass(frozen=True)
class TuneConfig:
    """`kuberl tune` (docs/tuning.md): an Optuna study over `space`, each trial a `kuberl up` run of
    this config with the trial's values; `kuberl up` itself ignores this section."""
    space: Mapping[str, TuneParam] = field(default_factory=dict, hash=False)  # dotted config key -> its range
    trials: int = 20                  # trials this invocation runs (a resumed study adds as many)
    parallel: int = 1                 # trials running at once (each a whole kuberl up run: mind the cores)
    metric: str = "return"            # "return": the training episodes' mean over run.return_window at the
    #                                   end; "evaluation": the final checkpoint's deterministic mean return
    pruner: str = "median"            # median: stop a trial whose return is below the median of earlier
    #                                   trials' at the same env steps; none: never
    prune_after_steps: int = 0        # no pruning before this many env steps
    prune_after_trials: int = 5       # nor before this many trials have completed (Optuna's n_startup_trials)
    report_every_steps: int = 0       # a trial's running return goes to the pruner this often (0: max_env_steps / 20)
    sampler: str = "tpe"
    seed: int = 0                     # the sampler's seed
    study: str | None = None          # default: <algorithm>-<env id>
    storage: str | None = None        # an Optuna storage URL; default sqlite:///<run.run_dir>/tune/<study>.db

    def __post_init__(self) -> None:
        require(self.trials >= 1, "trials", self.trials, "must be >= 1")
        require(self.parallel >= 1, "parallel", self.parallel, "must be >= 1")
        require(self.metric in TUNE_METRICS, "metric", self.metric, f"must be one of {', '.join(TUNE_METRICS)}")
        require(self.pruner in TUNE_PRUNERS, "pruner", self.pruner, f"must be one of {', '.join(TUNE_PRUNERS)}")
        require(self.sampler in TUNE_SAMPLERS, "sampler", self.sampler, f"must be one of {', '.join(TUNE_SAMPLERS)}")
        require(self.prune_after_steps >= 0, "prune_after_steps", self.prune_after_steps, "must be >= 0")
        require(self.prune_after_trials >= 0, "prune_after_trials", self.prune_after_trials, "must be >= 0")
        require(self.report_every_steps >= 0, "report_every_steps", self.report_every_steps, "must be >= 0")


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

    def __post_init__(self) -> None:
        require(self.episodes >= 1, "episodes", self.episodes, "must be >= 1")
        require(self.num_envs >= 1, "num_envs", self.num_envs, "must be >= 1")
        require(self.seed >= 0, "seed", self.seed, "must be >= 0 (gymnasium seeds are non-negative)")
        require(math.isfinite(self.max_seconds) and self.max_seconds >= 0, "max_seconds", self.max_seconds,
                "must be >= 0 (0 = no limit)")


@dataclass(frozen=True)
class RolePlanConfig:
    """The planner's bounds and step sizes for one scalable role (actor or learner)."""
    min: int = 1
    max: int = 8
    cost: float = 1.0          # budget units one replica uses (cores locally, pods or cores in a cluster)
    max_step_up: int = 2       # most replicas added by one decision
    max_step_down: int = 1     # most replicas removed by one decision

    def __post_init__(self) -> None:
        require(self.min >= 0, "min", self.min, "must be >= 0")
        require(self.max >= max(self.min, 1), "max", self.max, f"must be >= min ({self.min}) and >= 1")
        require(self.cost > 0, "cost", self.cost, "must be > 0")
        require(self.max_step_up >= 1, "max_step_up", self.max_step_up, "must be >= 1")
        require(self.max_step_down >= 1, "max_step_down", self.max_step_down, "must be >= 1")


@dataclass(frozen=True)
class KubernetesPlannerConfig:
    """Where the planner's Kubernetes backend finds and scales the roles (all in one namespace)."""
    # Keys of older configs that are gone, and what to write instead (see services/common/settings.build).
    _replaced: ClassVar[dict[str, str]] = {
        "learner_deployment": "replaced by planner.kubernetes.learner_statefulset: the learners are a StatefulSet "
                              "now (pod ordinal = rank in the group); rename the key (its value names the "
                              "learner StatefulSet, default kuberl-learner)"}
    namespace: str = ""                     # "" = the pod's own namespace in a cluster, else the kubeconfig's
    actor_deployment: str = "kuberl-actor"  # the actors: a Deployment
    learner_statefulset: str = "kuberl-learner"  # the learners: a StatefulSet (pod ordinal = rank in the group)
    actor_service: str = "kuberl-actor"     # headless Services whose Endpoints list the replicas
    learner_service: str = "kuberl-learner"
    buffer_service: str = "kuberl-buffer"
    # Buffer shards the planner adds and drains (planner.buffer): the buffer StatefulSet (shard i = pod
    # ordinal i), and shard i's address as actors and learners name it, "{i}" standing for the ordinal
    # (the chart: dns:///kuberl-buffer-{i}.kuberl-buffer:50051). Unset: the planner leaves the shards be.
    buffer_statefulset: str = "kuberl-buffer"
    buffer_address: str = ""
    grpc_port_name: str = "grpc"            # the Service port the planner reads GetStats on
    field_manager: str = "kuberl-planner"
    pause_annotation: str = "kuberl.io/planner-paused"  # "true" on the Deployment or StatefulSet: left alone
    leader_election: bool = True            # one active planner per namespace (a coordination.k8s.io Lease)
    lease_name: str = "kuberl-planner"
    lease_duration_s: float = 15.0
    qps: float = 5.0                        # client-side rate limit on API writes and reads
    burst: int = 10

    def __post_init__(self) -> None:
        require(self.qps > 0, "qps", self.qps, "must be > 0")
        require(self.burst >= 1, "burst", self.burst, "must be >= 1")
        require(self.lease_duration_s >= 2, "lease_duration_s", self.lease_duration_s, "must be >= 2")
        require(bool(self.field_manager), "field_manager", self.field_manager, "must not be empty")
        require(not self.buffer_address or self.buffer_address.count("{i}") == 1, "buffer_address",
                self.buffer_address, "must hold {i} once, where the shard's ordinal goes "
                "(e.g. dns:///kuberl-buffer-{i}.kuberl-buffer:50051), or be empty")


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
    # Buffer shards (docs/architecture.md, "Buffer shards"): unset, topology.buffers stays fixed; set, the
    # planner adds a shard while the run is communication-bound and drains one while every shard idles,
    # one shard at a time, within min..max (the local backend; see docs/planner.md). Not in the budget.
    buffer: RolePlanConfig | None = None
    kubernetes: KubernetesPlannerConfig = field(default_factory=KubernetesPlannerConfig)

    def __post_init__(self) -> None:
        require(self.backend in ("local", "kubernetes", "dry-run"), "backend", self.backend,
                "must be 'local', 'kubernetes' or 'dry-run'")
        require(self.interval_s > 0, "interval_s", self.interval_s, "must be > 0")
        require(self.costs in ("configured", "measured"), "costs", self.costs, "must be 'configured' or 'measured'")
        require(0 < self.tolerance < 1, "tolerance", self.tolerance, "must be in (0, 1)")
        require(self.budget >= 0, "budget", self.budget, "must be >= 0 (0 = no budget)")
        require(self.rate_halflife_s > 0, "rate_halflife_s", self.rate_halflife_s, "must be > 0")
        require(self.warmup_s >= 0, "warmup_s", self.warmup_s, "must be >= 0")
        require(self.cooldown_s > self.warmup_s, "cooldown_s", self.cooldown_s,
                f"must be longer than warmup_s ({self.warmup_s}): a change is judged only on warmed-up replicas")
        require(self.scale_down_window_s >= 0, "scale_down_window_s", self.scale_down_window_s, "must be >= 0")
        require(self.stale_after_s > 0, "stale_after_s", self.stale_after_s, "must be > 0")
        require(self.converge_timeout_s > 0, "converge_timeout_s", self.converge_timeout_s, "must be > 0")
        require(self.drain_timeout_s > 0, "drain_timeout_s", self.drain_timeout_s, "must be > 0")
        require(0 <= self.min_scale_gain <= 1, "min_scale_gain", self.min_scale_gain,
                "must be in [0, 1] (0 = scale-ups are not checked)")
        require(self.saturation_hold_s > 0, "saturation_hold_s", self.saturation_hold_s, "must be > 0")
        require(self.max_policy_lag >= 0, "max_policy_lag", self.max_policy_lag, "must be >= 0 (0 = no staleness target)")
        # (Whether the budget fits every role's minimum is the experiment's check: it knows the policies.)


@dataclass(frozen=True)
class CommonConfig:
    """The experiment without its algorithms' sections: what services/common reads (the whole config
    is services.config.ExperimentConfig, a CommonConfig). `algorithm` names the algorithm that trains."""
    algorithm: str = "ppo"
    seed: int = 0
    env: EnvConfig = field(default_factory=EnvConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    learner: LearnerConfig = field(default_factory=LearnerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    tls: TlsConfig = field(default_factory=TlsConfig)
    auth: AuthConfig = field(default_factory=AuthConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    selfplay: SelfPlayConfig = field(default_factory=SelfPlayConfig)
    # Several policies in one run, by name (none: one policy, `default`, plays every agent): each its
    # own learners, weights and version, and its own table in every buffer shard.
    policies: Mapping[str, PolicyConfig] = field(default_factory=dict, hash=False)
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
        require(not self.selfplay.enabled, "selfplay.enabled", True,
                why + "without self-play so far: self-play trains one policy against its own snapshots")

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

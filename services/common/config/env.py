"""The `env` section: which environment actors step and how many copies (services/common/envs.py makes
them for the actors and `kuberl eval`; the networks take its spaces), Atari's preprocessing (`env.atari`),
and the spaces declared for simulators not in gymnasium (`env.*`; each of several policies declares its
own the same way, config/policies.py)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from services.common.protocol import spaces
from services.common.settings import ConfigError, require


@dataclass(frozen=True)
class AtariConfig:
    """Preprocessing of Atari games (env ids `ALE/<Game>-v5`), after Machado et al. 2018 and the
    Nature DQN: frames are 84x84 grey uint8, the last `frame_stack` stacked, `frameskip` frames per
    action (max-pooled over the last two), up to `noop_max` no-ops at reset. Observations stay uint8
    all the way to the learner; the networks divide by 255 inside their forward pass.
    """
    # "ale_vector": ale-py's native, multi-threaded AtariVectorEnv (fast; the default);
    # "gymnasium": gymnasium's ALE/*-v5 env per copy with AtariPreprocessing + FrameStackObservation.
    backend: str = "ale_vector"       # ale_vector: ale-py's multi-threaded vector env; gymnasium: one ALE env per copy
    frame_stack: int = 4              # frames stacked into one observation
    frameskip: int = 4                # frames per action (the action repeated; the last two max-pooled)
    screen_size: int = 84             # frames are resized to screen_size x screen_size grey pixels
    noop_max: int = 30                # up to this many no-op actions at reset (random starts)
    # A lost life is a terminal step in fragments (no bootstrap through it) while the game goes on,
    # as SB3's and CleanRL's EpisodicLifeEnv; episode returns are still logged per whole game.
    # Off by default: Pong has no lives.
    episodic_life: bool = False       # a lost life ends a fragment's episode (no bootstrap through it); the game goes on
    # Rewards stored in fragments are sign(r) (Mnih et al. 2015); episode returns are logged unclipped.
    clip_rewards: bool = True         # rewards in fragments are sign(r); reported episode returns stay unclipped
    # Sticky actions: 0.0 as in the NoFrameskip-v4 setting of CleanRL and the SB3 zoo (v5 defaults to 0.25).
    repeat_action_probability: float = 0.0  # sticky actions: the previous action is repeated with this probability
    full_action_space: bool = False   # all 18 Atari actions instead of the game's minimal set
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
    type: str                         # discrete, multi_discrete or box (required)
    n: int | None = None              # discrete: the number of actions
    nvec: tuple[int, ...] | None = None  # multi_discrete: the number of actions of each choice
    shape: tuple[int, ...] | None = None  # box: the action's shape (float32)
    low: tuple[float, ...] | None = None  # box: lower bounds, one for all elements or one per element (omitted: unbounded)
    high: tuple[float, ...] | None = None  # box: upper bounds, one for all elements or one per element (omitted: unbounded)

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
    observation_shape: tuple[int, ...] | None = None  # env.mode external: a Box observation's shape
    observation_dtype: str = "float32"  # the Box observation's dtype
    observation_keys: dict[str, tuple[int, ...]] | None = None  # env.mode external: a Dict observation, each key's shape
    num_actions: int | None = None    # env.mode external: a Discrete action space of this many actions
    action_space: ActionSpaceConfig | None = None  # env.mode external: the action space (discrete, multi_discrete, box)

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
    id: str = "CartPole-v1"           # a gymnasium id, ALE/<Game>-v5, pettingzoo:<module>, or module:EnvId (module
    #                                   is imported first, by every process that makes the env: PYTHONPATH=.)
    num_envs: int = 8                 # env copies each actor steps in one vector env (default 8); local mode
    seed: int = 0                     # base seed; actor i uses seed + 1000 * i
    max_episode_steps: int | None = None  # override the env's time limit
    mode: str = "local"               # local: actors step the env; external: simulators connect over EnvSession
    atari: AtariConfig = field(default_factory=AtariConfig)  # used when `id` is ALE/<Game>-v5
    # Keyword arguments for the env's constructor: gymnasium.make's, or a PettingZoo module's
    # parallel_env()/env() (e.g. {N: 3, max_cycles: 25, continuous_actions: false} for simple_spread).
    kwargs: dict[str, int | float | str | bool] = field(default_factory=dict)  # keyword arguments of the env's maker

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

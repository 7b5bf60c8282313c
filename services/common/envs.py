"""Environments actors step, and the spaces the networks see: gymnasium ids, Atari (ALE/<Game>-v5)
and PettingZoo envs (`pettingzoo:<module>`, several agents per copy: services/common/agents.py).

Atari games go through standard preprocessing (AtariConfig: 84x84 grey, frame stack, frameskip with
max-pooling, no-op reset, optional episodic life), either with ale-py's native multi-threaded
`AtariVectorEnv` (backend "ale_vector") or with gymnasium's `ALE/*-v5` envs wrapped in
`AtariPreprocessing` + `FrameStackObservation` (backend "gymnasium"). Both give [N, stack, 84, 84]
uint8 observations and autoreset in SAME_STEP mode with the true last observation in
`info["final_obs"]`, which is what rollouts expect. Frames are never converted to float here.
Episodic life and reward clipping are left to the actor's rollout (services/actor/rollout.py): ale-py's
own episodic_life restarts the whole game at every lost life, which is not the EpisodicLifeEnv
semantics the reference hyper-parameters were tuned with.

Imports gymnasium and ale-py (lazily): only actors and learners may import this module.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

import numpy as np

from services.common.agents import ParallelVectorEnv, is_pettingzoo, make_parallel
from services.common.config import CommonConfig, EnvConfig, is_atari
from services.common.settings import ConfigError
from services.common.protocol.spaces import EnvSpec as EnvSpec  # also re-exported
from services.common.protocol.spaces import (Discrete, DictLayout, MultiDiscrete, check_observations, dict_categories,
                                             dict_layout, discrete_spec, flat_size, flatten_dict, from_gymnasium,
                                             observation_space)

if TYPE_CHECKING:
    import gymnasium


def atari_game(env_id: str) -> str:
    """`ALE/Pong-v5` -> `pong`, the ROM name ale-py's vector env takes."""
    name = env_id.split("/", 1)[1].rsplit("-", 1)[0]
    # ROM ids are snake_case: SpaceInvaders -> space_invaders.
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


def _import_ale() -> ModuleType:
    try:
        import ale_py
    except ImportError as err:  # a clear message instead of gymnasium's NamespaceNotFound
        raise ValueError("env.id: Atari envs need ale-py (pip install 'kuberl[actor]')") from err
    return ale_py


def make_vector_env(cfg: EnvConfig, num_envs: int | None = None, render_mode: str | None = None,
                    policies: Mapping[str, Sequence[str]] | None = None) -> gymnasium.vector.VectorEnv[Any, Any, Any]:
    """A vector env of `num_envs` (default cfg.num_envs) copies, SAME_STEP autoreset. Blocking.

    `render_mode` (e.g. "rgb_array", for `kuberl eval --video`) is passed to every copy; Atari games
    then need env.atari.backend "gymnasium" (ale-py's vector env does not render).
    Raises ValueError naming `env.id` for an unknown game. `policies` (name -> agent patterns): a
    PettingZoo env's agents split among a run's several policies (services/common/agents.py).
    """
    import gymnasium as gym

    n = cfg.num_envs if num_envs is None else num_envs
    if is_pettingzoo(cfg.id):   # several agents per copy: one slot each (services/common/agents.py)
        return ParallelVectorEnv(make_parallel(cfg.id, {**cfg.kwargs, **({} if render_mode is None else
                                                                           {"render_mode": render_mode})}),
                                 n, cfg.id, policies)  # type: ignore[return-value]
    render = {} if render_mode is None else {"render_mode": render_mode}
    if not is_atari(cfg.id):
        # gymnasium types `wrappers` as returning a Wrapper; make_vec applies them, any Env will do.
        return gym.make_vec(cfg.id, num_envs=n, vectorization_mode="sync",
                            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
                            wrappers=[_flatten_dict],  # type: ignore[list-item]
                            max_episode_steps=cfg.max_episode_steps, **render, **cfg.kwargs)
    ale_py = _import_ale()
    a = cfg.atari
    game = atari_game(cfg.id)
    if game not in ale_py.roms.get_all_rom_ids():
        raise ValueError(f"env.id: {cfg.id!r} is not an Atari game ale-py knows (ROM {game!r} not found)")
    if a.backend == "ale_vector":
        if render_mode is not None:
            raise ValueError(f"env.atari.backend: 'ale_vector' envs do not render ({render_mode!r} asked for); "
                             "use the 'gymnasium' backend")
        from ale_py.vector_env import AtariVectorEnv

        frames: dict[str, Any] = {} if cfg.max_episode_steps is None else {
            "max_num_frames_per_episode": cfg.max_episode_steps * a.frameskip}
        return AtariVectorEnv(
            game, n, num_threads=a.threads or 0, autoreset_mode="SameStep", img_height=a.screen_size,
            img_width=a.screen_size, grayscale=True, stack_num=a.frame_stack, frameskip=a.frameskip, maxpool=True,
            noop_max=a.noop_max, reward_clipping=False,  # rewards are clipped, and lives handled, by the actor
            episodic_life=False,
            repeat_action_probability=a.repeat_action_probability, full_action_space=a.full_action_space,
            use_fire_reset=True, **frames)
    gym.register_envs(ale_py)
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    def wrap(env: gymnasium.Env[Any, Any]) -> gymnasium.Wrapper[Any, Any, Any, Any]:
        env = AtariPreprocessing(env, noop_max=a.noop_max, frame_skip=a.frameskip, screen_size=a.screen_size,
                                 terminal_on_life_loss=False, grayscale_obs=True, scale_obs=False)
        return FrameStackObservation(env, a.frame_stack)

    # frameskip=1 in the base env: AtariPreprocessing skips (and max-pools) itself.
    return gym.make_vec(cfg.id, num_envs=n, vectorization_mode="sync",
                        vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP},
                        wrappers=[wrap], frameskip=1, repeat_action_probability=a.repeat_action_probability,
                        full_action_space=a.full_action_space, max_episode_steps=cfg.max_episode_steps, **render)


def _flatten_dict(env: gymnasium.Env[Any, Any]) -> gymnasium.Env[Any, Any]:
    """A Dict observation flattened into one float32 vector (the keys in sorted order, each Box
    row-major: gymnasium's flatten; a Discrete or MultiDiscrete key as its integers, which the policy
    one-hots: spaces.py), which is what the policy networks take; others as they are."""
    import gymnasium as gym

    space = env.observation_space
    if not isinstance(space, gym.spaces.Dict):
        return env
    layout, discrete = _dict_parts(space)
    if not discrete:   # (Boxes only: gymnasium's flatten)
        from gymnasium.wrappers import DtypeObservation, FlattenObservation

        return DtypeObservation(FlattenObservation(env), np.float32)
    return _flat_dict_env(env, layout, discrete)


def _dict_parts(space: Any) -> tuple[DictLayout, dict[str, Discrete | MultiDiscrete]]:
    """A gymnasium Dict observation space's layout and its Discrete and MultiDiscrete keys; ValueError
    for a key of any other space."""
    import gymnasium as gym

    discrete = {}
    for key, sub in space.spaces.items():
        if isinstance(sub, (gym.spaces.Discrete, gym.spaces.MultiDiscrete)):
            discrete[key] = observation_space(sub, f"observation space {space}: key {key!r}")
        elif not isinstance(sub, gym.spaces.Box):
            raise ValueError(f"observation space {space}: a Dict observation must hold only Box, Discrete and "
                             f"MultiDiscrete spaces (key {key!r} is {sub})")
    return dict_layout({k: discrete[k].shape if k in discrete else s.shape for k, s in space.spaces.items()}), discrete


def _flat_dict_env(env: gymnasium.Env[Any, Any], layout: DictLayout,
              discrete: dict[str, Discrete | MultiDiscrete]) -> gymnasium.Env[Any, Any]:
    """`env` with its Dict observations flattened (spaces.flatten_dict), Discrete keys as their
    integers; a Discrete value outside its space raises ValueError naming the key (bad data, never
    recorded or acted on)."""
    import gymnasium as gym

    env_id = env.spec.id if env.spec is not None else type(env.unwrapped).__name__
    size = flat_size(layout)
    low, high = np.full(size, -np.inf, np.float32), np.full(size, np.inf, np.float32)
    offset = 0
    for key, shape in layout:
        n = int(np.prod(shape))
        sub = env.observation_space.spaces[key]  # type: ignore[attr-defined]
        if key in discrete:
            d = discrete[key]
            low[offset:offset + n] = 0
            high[offset:offset + n] = np.asarray(d.nvec if isinstance(d, MultiDiscrete) else d.n) - 1
        else:
            low[offset:offset + n] = np.asarray(sub.low, np.float32).reshape(-1)
            high[offset:offset + n] = np.asarray(sub.high, np.float32).reshape(-1)
        offset += n
    # (what check_observations reads of a spec: the observation's layout; the action space is not used)
    spec = EnvSpec((size,), np.dtype(np.float32), Discrete(1), layout, dict_categories(layout, discrete))

    class FlatDict(gym.ObservationWrapper):
        def __init__(self) -> None:
            super().__init__(env)
            self.observation_space = gym.spaces.Box(low, high, (size,), np.float32)

        def observation(self, observation: Any) -> np.ndarray:
            flat = flatten_dict(observation, layout)
            try:
                check_observations(spec, flat, "observation")
            except ValueError as err:
                raise ValueError(f"env.id: {env_id} returned {err}; the actor stops rather than record it") from None
            return flat

    return FlatDict()


def env_spec(cfg: EnvConfig) -> EnvSpec:
    """The observation and action spaces of the env actors step (after any preprocessing). Blocking."""
    import gymnasium as gym

    if is_atari(cfg.id):
        a = cfg.atari
        env = make_vector_env(cfg, num_envs=1)
        try:
            act = env.single_action_space
            assert isinstance(act, gym.spaces.Discrete)   # Atari games (either backend) have Discrete actions
            return EnvSpec((a.frame_stack, a.screen_size, a.screen_size), np.dtype(np.uint8), Discrete(int(act.n)))
        finally:
            env.close()
    if is_pettingzoo(cfg.id):
        agents = ParallelVectorEnv(make_parallel(cfg.id, cfg.kwargs), 1, cfg.id)
        try:
            return _spec_of_spaces(cfg.id, agents.single_observation_space, agents.single_action_space)
        finally:
            agents.close()
    raw = gym.make(cfg.id, max_episode_steps=cfg.max_episode_steps, **cfg.kwargs)  # type: ignore[arg-type]
    try:
        return _spec_of_spaces(cfg.id, raw.observation_space, raw.action_space, dicts=True)
    finally:
        raw.close()


def _spec_of_spaces(env_id: str, obs: Any, act: Any, dicts: bool = False) -> EnvSpec:
    """The EnvSpec of an observation space and an action space; ValueError naming env.id for what
    kuberl cannot train on yet. `dicts`: a Dict observation is flattened (`_flatten_dict`: gymnasium
    envs; PettingZoo agents' are not). (PettingZoo's spaces are gymnasium's.)"""
    import gymnasium as gym

    try:
        action = from_gymnasium(act)
    except ValueError as err:
        raise ValueError(f"env.id: {env_id}: {err}") from None
    try:
        if isinstance(obs, gym.spaces.Box):
            return EnvSpec(tuple(obs.shape), np.dtype(obs.dtype), action)
        if isinstance(obs, (gym.spaces.Discrete, gym.spaces.MultiDiscrete)):
            return discrete_spec(observation_space(obs), action)
        if dicts and isinstance(obs, gym.spaces.Dict):
            layout, discrete = _dict_parts(obs)
            return EnvSpec((flat_size(layout),), np.dtype(np.float32), action, layout,
                           dict_categories(layout, discrete))
    except ValueError as err:
        raise ValueError(f"env.id: {env_id}: {err}") from None
    raise ValueError(f"env.id: {env_id} has observation space {obs}; kuberl takes Box, Discrete, MultiDiscrete"
                     + (" and a Dict of those" if dicts else ""))


def spec_of(cfg: EnvConfig) -> EnvSpec:
    """The policy's spaces: declared ones (external simulators), else the local env's."""
    declared = cfg.declared_spec
    return env_spec(cfg) if declared is None else declared


def policy_specs(cfg: CommonConfig) -> dict[str, EnvSpec]:
    """Each policy's spaces, by name (a run of one policy: `spec_of`, under its name): in a run of several
    (config `policies`), the spaces of each policy's agents (external simulators: each policy's declared
    ones, else the env's). Blocking (the env is made once). ValueError
    naming the key where the agents do not map onto the policies or a group's agents' spaces differ."""
    if not cfg.policies:   # one policy plays every agent: the env's own spaces
        return {cfg.policy_names[0]: spec_of(cfg.env)}
    if cfg.env.mode == "external":   # each policy's declared spaces, else the env's
        return {name: p.declared_spec or spec_of(cfg.env) for name, p in cfg.policies.items()}
    agents = ParallelVectorEnv(make_parallel(cfg.env.id, cfg.env.kwargs), 1, cfg.env.id,
                               {name: p.agents for name, p in cfg.policies.items()})
    try:
        return group_specs(agents)
    finally:
        agents.close()


def group_specs(agents: ParallelVectorEnv) -> dict[str, EnvSpec]:
    """The spaces of each group of a PettingZoo vector env's agents, by policy name."""
    return {g.name: _spec_of_spaces(agents.env_id, g.observation_space, g.action_space) for g in agents.groups}


def policy_spec(cfg: CommonConfig, policy: str) -> EnvSpec:
    """The spaces of one policy's agents (`policy_specs`)."""
    return policy_specs(cfg)[policy]


def made_spec(cfg: EnvConfig) -> EnvSpec:
    """The run's env spec (`spec_of`), read by making the env once where no spaces are declared.
    Blocking. ConfigError naming `env.id` when the env cannot be made here."""
    declared = cfg.declared_spec
    if declared is not None:
        return declared
    try:
        return env_spec(cfg)
    except Exception as err:  # noqa: BLE001 - gymnasium raises its own errors for an env it cannot make
        lines = str(err).strip().splitlines()
        detail = lines[0] if lines else ""
        if isinstance(err, ValueError) and detail.startswith("env.id: "):  # env_spec's own, naming the key
            raise ConfigError("env.id", detail.removeprefix("env.id: ")) from None
        raise ConfigError("env.id", f"{cfg.id!r} cannot be made here ({type(err).__name__}"
                                    f"{': ' + detail if detail else ''})") from None

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
from services.common.protocol.spaces import Discrete, dict_layout, from_gymnasium

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
    """A Dict-of-Box observation flattened into one float32 vector (the keys in sorted order, each
    Box row-major: gymnasium's flatten), which is what the policy networks take; others as they are."""
    import gymnasium as gym

    space = env.observation_space
    if not isinstance(space, gym.spaces.Dict):
        return env
    if not all(isinstance(s, gym.spaces.Box) for s in space.spaces.values()):
        raise ValueError(f"observation space {space}: a Dict observation must hold only Box spaces")
    from gymnasium.wrappers import DtypeObservation, FlattenObservation

    return DtypeObservation(FlattenObservation(env), np.float32)


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
    # (its spaces are Boxes, whose shape gymnasium types as set: _flatten_dict refuses any other)
    keys = (dict_layout({k: s.shape for k, s in raw.observation_space.spaces.items()})  # type: ignore[misc]
            if isinstance(raw.observation_space, gym.spaces.Dict) else None)
    flat = _flatten_dict(raw)
    try:
        return _spec_of_spaces(cfg.id, flat.observation_space, flat.action_space, keys)
    finally:
        flat.close()


def _spec_of_spaces(env_id: str, obs: Any, act: Any, keys: Any = None) -> EnvSpec:
    """The EnvSpec of a (flattened) observation space and an action space; ValueError naming env.id for
    what kuberl cannot train on yet. (PettingZoo's spaces are gymnasium's.)"""
    import gymnasium as gym

    if not isinstance(obs, gym.spaces.Box):
        raise ValueError(f"env.id: {env_id} has observation space {obs}; only Box is supported so far")
    try:
        action = from_gymnasium(act)
    except ValueError as err:
        raise ValueError(f"env.id: {env_id}: {err}") from None
    return EnvSpec(tuple(obs.shape), np.dtype(obs.dtype), action, keys)


def spec_of(cfg: EnvConfig) -> EnvSpec:
    """The policy's spaces: declared ones (external simulators), else the local env's."""
    declared = cfg.declared_spec
    return env_spec(cfg) if declared is None else declared


def policy_specs(cfg: CommonConfig) -> dict[str, EnvSpec]:
    """Each policy's spaces, by name (a run of one policy: `spec_of`, under its name): in a run of several
    (config `policies`), the spaces of each policy's agents (external simulators: each policy's declared
    ones, else the env's). Blocking (the env is made once). ValueError
    naming the key where the agents do not map onto the policies or a group's agents' spaces differ."""
    if not cfg.several_policies:
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
    return spec_of(cfg.env) if not cfg.several_policies else policy_specs(cfg)[policy]


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

"""Policy networks shared by the actor (inference) and the learner (training), as in CleanRL.

Imports torch and gymnasium: only the actor and the learner may import this module (an
import-linter contract keeps the buffer and planner away from it).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical


@dataclass(frozen=True)
class EnvSpec:
    """What the networks need to know about an environment."""
    obs_shape: tuple[int, ...]
    obs_dtype: np.dtype
    num_actions: int


def spec_of(env_cfg) -> EnvSpec:
    """The policy's spaces for an EnvConfig: declared ones (external simulators), else the gymnasium env's."""
    if env_cfg.observation_shape is not None:
        return EnvSpec(tuple(env_cfg.observation_shape), np.dtype(env_cfg.observation_dtype), env_cfg.num_actions)
    return env_spec(env_cfg.id, env_cfg.max_episode_steps)


def env_spec(env_id: str, max_episode_steps: int | None = None) -> EnvSpec:
    """Read the spaces of a gymnasium env (only Box observations and Discrete actions so far)."""
    import gymnasium as gym

    env = gym.make(env_id, max_episode_steps=max_episode_steps)
    try:
        obs, act = env.observation_space, env.action_space
        if not isinstance(act, gym.spaces.Discrete):
            raise ValueError(f"env.id: {env_id} has action space {act}; only Discrete is supported so far")
        if not isinstance(obs, gym.spaces.Box):
            raise ValueError(f"env.id: {env_id} has observation space {obs}; only Box is supported so far")
        return EnvSpec(tuple(obs.shape), np.dtype(obs.dtype), int(act.n))
    finally:
        env.close()


def _layer(inp: int, out: int, std: float = np.sqrt(2), bias: float = 0.0) -> nn.Linear:
    layer = nn.Linear(inp, out)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


def _mlp(inp: int, hidden: tuple[int, ...], out: int, act: type[nn.Module], out_std: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [_layer(inp, h), act()]
        inp = h
    layers.append(_layer(inp, out, std=out_std))
    return nn.Sequential(*layers)


class QNetwork(nn.Module):
    """Q(s, .) for discrete actions."""

    def __init__(self, spec: EnvSpec, hidden: tuple[int, ...]):
        super().__init__()
        self.q = _mlp(int(np.prod(spec.obs_shape)), hidden, spec.num_actions, nn.ReLU, out_std=1.0)

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.q(obs.flatten(1).float())


class ActorCritic(nn.Module):
    """Separate policy and value MLPs (tanh), CleanRL's PPO initialisation."""

    def __init__(self, spec: EnvSpec, hidden: tuple[int, ...]):
        super().__init__()
        n_in = int(np.prod(spec.obs_shape))
        self.critic = _mlp(n_in, hidden, 1, nn.Tanh, out_std=1.0)
        self.actor = _mlp(n_in, hidden, spec.num_actions, nn.Tanh, out_std=0.01)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(obs.flatten(1).float()).squeeze(-1)

    def dist(self, obs: torch.Tensor) -> Categorical:
        return Categorical(logits=self.actor(obs.flatten(1).float()))


def build_network(algorithm: str, spec: EnvSpec, hidden: tuple[int, ...]) -> nn.Module:
    return ActorCritic(spec, hidden) if algorithm == "ppo" else QNetwork(spec, hidden)


def to_numpy(module: nn.Module) -> dict[str, np.ndarray]:
    """The module's parameters and buffers as CPU numpy arrays (copies)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def load_numpy(module: nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Load arrays produced by `to_numpy` (possibly read-only views) into `module`; strict names and shapes."""
    state = {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}
    module.load_state_dict(state, strict=True)

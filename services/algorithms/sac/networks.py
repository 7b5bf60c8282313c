"""SAC's networks: the tanh-squashed Gaussian policy actors run, and the twin Q critic only the learner has.

The policy's log-std is state-dependent and squashed into [LOG_STD_MIN, LOG_STD_MAX] by a tanh, as
in CleanRL's sac_continuous_action.py. A sample u ~ N(mean, std) becomes the action
a = tanh(u) * scale + bias, which lies within the Box's bounds; its log-prob carries the change of
variables (Haarnoja et al. 2018, appendix C):
    log pi(a|s) = sum_i [log N(u_i; mean_i, std_i) - log(scale_i) - log(1 - tanh(u_i)^2)],
with log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)), which stays finite where tanh(u) rounds to +-1.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from services.common.envs import EnvSpec
from services.common.models.nets import OneHot, flat_obs, mlp
from services.common.protocol.spaces import Box

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0


def squashed_log_prob(normal: torch.distributions.Normal, u: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """log pi(a) of a = tanh(u) * scale + bias for the pre-squash sample `u` [B, D] of `normal`: [B]."""
    log_det = torch.log(scale) + 2.0 * (math.log(2.0) - u - F.softplus(-2.0 * u))
    log_prob: torch.Tensor = normal.log_prob(u)
    return (log_prob - log_det).sum(-1)


class SquashedGaussianActor(nn.Module):
    """pi(.|s) over flat observations; `scale`/`bias` map tanh's (-1, 1) onto the Box's bounds (buffers,
    so an actor's copy agrees with the learner's). `validate`: whether the Gaussian checks its
    parameters; the learner's does not (as services/common/models/heads.py's `Head.validate`): a non-finite
    output becomes a non-finite loss, whose step is skipped, instead of an exception."""
    validate: bool = True
    scale: torch.Tensor   # buffers (register_buffer)
    bias: torch.Tensor

    def __init__(self, spec: EnvSpec, hidden: tuple[int, ...]):
        super().__init__()
        assert isinstance(spec.action, Box)   # (SAC takes Box actions only: Algorithm.check_spec)
        self.shape = spec.action.shape
        self.dims = int(np.prod(self.shape))
        self.one_hot = OneHot(spec)   # (categorical observations one-hot encoded)
        self.net = mlp(self.one_hot.width, hidden, 2 * self.dims, nn.ReLU, out_std=0.01)
        low = torch.as_tensor(spec.action.low_array.reshape(-1))
        high = torch.as_tensor(spec.action.high_array.reshape(-1))
        self.register_buffer("scale", (high - low) / 2.0)
        self.register_buffer("bias", (high + low) / 2.0)

    def forward(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-squash Gaussian's mean and log-std, [B, D] each."""
        mean, raw = self.net(self.one_hot(flat_obs(obs))).chunk(2, dim=-1)
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (torch.tanh(raw) + 1.0)
        return mean, log_std

    def sample(self, obs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterised action [B, *shape] (differentiable in the weights) and its log-prob [B]."""
        mean, log_std = self(obs)
        normal = torch.distributions.Normal(mean, log_std.exp(), validate_args=self.validate)
        u = normal.rsample()
        action = torch.tanh(u) * self.scale + self.bias
        return action.view(-1, *self.shape), squashed_log_prob(normal, u, self.scale)

    def mode(self, obs: torch.Tensor) -> torch.Tensor:
        """The deterministic action (the squashed mean), for evaluation."""
        mean, _ = self(obs)
        return (torch.tanh(mean) * self.scale + self.bias).view(-1, *self.shape)


class TwinQ(nn.Module):
    """Two independent Q(s, a) MLPs (clipped double-Q, Fujimoto et al. 2018)."""

    def __init__(self, spec: EnvSpec, hidden: tuple[int, ...]):
        super().__init__()
        self.one_hot = OneHot(spec)
        n_in = self.one_hot.width + int(np.prod(spec.action.shape))
        self.q1 = mlp(n_in, hidden, 1, nn.ReLU, out_std=1.0)
        self.q2 = mlp(n_in, hidden, 1, nn.ReLU, out_std=1.0)

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.one_hot(flat_obs(obs)), action.flatten(1)], dim=1)
        return self.q1(x).squeeze(-1), self.q2(x).squeeze(-1)

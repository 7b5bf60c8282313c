"""DQN's network (torch): Q-values over a discrete action space."""

from __future__ import annotations

import torch
from torch import nn

from services.common.models.nets import EnvSpec, NatureCNN, OneHot, flat_obs, is_image, layer, mlp


class QNetwork(nn.Module):
    """Q(s, .) for discrete actions: an MLP over flat observations (their categorical elements one-hot
    encoded), or the Nature CNN over frames (then `hidden` is unused: the CNN's 512-unit layer is the
    hidden layer)."""

    def __init__(self, spec: EnvSpec, hidden: tuple[int, ...]):
        super().__init__()
        if is_image(spec):
            torso = NatureCNN(spec)
            self.q = nn.Sequential(torso, layer(torso.features, spec.num_actions, std=1.0))
            self._flat = False
        else:
            self.one_hot = OneHot(spec)
            self.q = mlp(self.one_hot.width, hidden, spec.num_actions, nn.ReLU, out_std=1.0)
            self._flat = True

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        q: torch.Tensor = self.q(self.one_hot(flat_obs(obs)) if self._flat else obs)
        return q

    def mode(self, obs: torch.Tensor) -> torch.Tensor:
        """The greedy action: argmax_a Q(s, a)."""
        q: torch.Tensor = self(obs)
        return q.argmax(dim=1)

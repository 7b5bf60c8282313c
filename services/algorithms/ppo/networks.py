"""PPO's network (torch): a policy head over any action space and a value head."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from services.common.models.heads import ActionDist, Head, out_features
from services.common.models.nets import EnvSpec, NatureCNN, ObsNormalizer, is_image, layer, mlp


class ActorCritic(nn.Module):
    """Policy and value heads. Flat observations: separate tanh MLPs (CleanRL's ppo.py). Frames: one
    shared Nature CNN torso with a policy head (std 0.01) and a value head (std 1), as in CleanRL's
    ppo_atari.py. The policy's output layer parameterises the action space's distribution
    (services/common/models/heads.py: categorical, a product of categoricals, or a diagonal Gaussian)."""

    def __init__(self, spec: EnvSpec, hidden: tuple[int, ...], normalize_obs: bool = False, obs_clip: float = 10.0):
        super().__init__()
        n_out = out_features(spec.action)
        if normalize_obs and is_image(spec):
            raise ValueError("ppo.normalize_observations: frames are scaled by 1/255 in the network; "
                             "normalisation is for flat observations")
        # Observation statistics (a module only when used: checkpoints without it stay loadable).
        self.obs_norm = ObsNormalizer(int(np.prod(spec.obs_shape)), obs_clip) if normalize_obs else None
        self.torso: nn.Module
        self.critic: nn.Module
        self.actor: nn.Module
        if is_image(spec):
            cnn = NatureCNN(spec)
            self.torso = cnn
            self.critic = layer(cnn.features, 1, std=1.0)
            self.actor = layer(cnn.features, n_out, std=0.01)
        else:
            n_in = int(np.prod(spec.obs_shape))
            self.torso = nn.Flatten(1)
            self.critic = mlp(n_in, hidden, 1, nn.Tanh, out_std=1.0)
            self.actor = mlp(n_in, hidden, n_out, nn.Tanh, out_std=0.01)
        self.head = Head(spec.action)
        self._flat = not is_image(spec)

    def _features(self, obs: torch.Tensor) -> torch.Tensor:
        if not self._flat:
            features: torch.Tensor = self.torso(obs)
            return features
        x = obs.flatten(1).float()
        return x if self.obs_norm is None else self.obs_norm(x)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        v: torch.Tensor = self.critic(self._features(obs))
        return v.squeeze(-1)

    def dist(self, obs: torch.Tensor, mask: torch.Tensor | None = None) -> ActionDist:
        """The action distribution at `obs` ([B, ...]); `mask` [B, M] bool: the allowed actions."""
        dist: ActionDist = self.head(self.actor(self._features(obs)), mask)
        return dist

    def mode(self, obs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The most likely action at `obs` (heads.Head.mode): argmax of the logits, or the Gaussian's mean."""
        return self.head.mode(self.actor(self._features(obs)), mask)

    def dist_and_value(self, obs: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[ActionDist, torch.Tensor]:
        """Both heads from one pass through the torso (what the PPO update needs per minibatch)."""
        x = self._features(obs)
        v: torch.Tensor = self.critic(x)
        return self.head(self.actor(x), mask), v.squeeze(-1)

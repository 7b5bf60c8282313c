"""Policy heads: the action distribution a policy network's output layer parameterises, per action space.

| space | head | layer output | log_prob / entropy |
|---|---|---|---|
| Discrete(n) | categorical over n logits | n | of the action |
| MultiDiscrete(nvec) | a product of independent categoricals | sum(nvec) logits, one run per choice | summed over choices |
| Box(shape) | diagonal Gaussian, state-independent log-std (CleanRL's ppo_continuous_action) | prod(shape) means | summed over elements |

Masks (Discrete, MultiDiscrete): the logits of disallowed actions are set to a large negative value
before the distribution is made (Huang & Ontanon 2020, "A Closer Look at Invalid Action Masking"), so
they are never sampled, their probability is ~0 and the allowed ones are renormalised. Box samples
are unbounded: the actor clips what it sends to the env, and log-probs are of the unclipped sample.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical, Distribution, Normal

from services.common.protocol.spaces import ActionSpace, Box, Discrete, MultiDiscrete

MASKED_LOGIT = -1e8


def out_features(space: ActionSpace) -> int:
    """Width of the layer that parameterises the head."""
    if isinstance(space, Discrete):
        return space.n
    if isinstance(space, MultiDiscrete):
        return sum(space.nvec)
    return int(np.prod(space.shape))


def _masked(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    return logits if mask is None else logits.masked_fill(~mask.bool(), MASKED_LOGIT)


class MultiCategorical:
    """Independent categoricals over runs of logits (one per choice); actions [B, k]."""

    def __init__(self, logits: torch.Tensor, nvec: tuple[int, ...], validate_args: bool = True):
        self.parts: list[Categorical] = [Categorical(logits=part, validate_args=validate_args)
                      for part in torch.split(logits, list(nvec), dim=-1)]

    def sample(self) -> torch.Tensor:
        return torch.stack([d.sample() for d in self.parts], dim=-1)

    def mode(self) -> torch.Tensor:
        return torch.stack([d.logits.argmax(-1) for d in self.parts], dim=-1)

    def log_prob(self, actions: torch.Tensor) -> torch.Tensor:
        total: torch.Tensor = sum(d.log_prob(actions[..., i]) for i, d in enumerate(self.parts))
        return total

    def entropy(self) -> torch.Tensor:
        total: torch.Tensor = sum(d.entropy() for d in self.parts)
        return total


class ModeCategorical(Categorical):
    # A method, as the other heads' `mode()`, where torch's distributions have a property.
    def mode(self) -> torch.Tensor:  # type: ignore[override]
        return self.logits.argmax(-1)


class DiagGaussian:
    """A diagonal Gaussian over actions [B, *shape]; log_prob and entropy summed over the elements."""

    def __init__(self, mean: torch.Tensor, log_std: torch.Tensor, shape: tuple[int, ...], validate_args: bool = True):
        self.shape = shape
        self.normal: Distribution = Normal(mean, log_std.expand_as(mean).exp(), validate_args=validate_args)

    def sample(self) -> torch.Tensor:
        return self.normal.sample().view(-1, *self.shape)

    def mode(self) -> torch.Tensor:
        return self.normal.mean.view(-1, *self.shape)

    def log_prob(self, actions: torch.Tensor) -> torch.Tensor:
        return self.normal.log_prob(actions.reshape(self.normal.mean.shape)).sum(-1)

    def entropy(self) -> torch.Tensor:
        return self.normal.entropy().sum(-1)


ActionDist = DiagGaussian | MultiCategorical | ModeCategorical


class Head(nn.Module):
    """Turns the output layer's values into the space's distribution. Holds the Gaussian's
    state-independent `log_std` (a parameter: it is trained, and reaches actors with the weights).

    `validate`: whether the distributions check their parameters (torch's validate_args). An actor's
    do, so a non-finite output raises rather than becoming an action; a learner's need not (PPO turns
    it off), so a non-finite output becomes a non-finite loss, whose step is skipped and counted
    (services/algorithms/group.py, `finite_gradients`) instead of ending the process."""
    validate: bool = True

    def __init__(self, space: ActionSpace):
        super().__init__()
        self.space = space
        if isinstance(space, Box):
            self.log_std = nn.Parameter(torch.zeros(out_features(space)))

    def forward(self, out: torch.Tensor, mask: torch.Tensor | None = None) -> ActionDist:
        space = self.space
        if isinstance(space, Box):
            if mask is not None:
                raise ValueError(f"{space} takes no action mask")
            return DiagGaussian(out, self.log_std, space.shape, self.validate)
        if isinstance(space, MultiDiscrete):
            return MultiCategorical(_masked(out, mask), space.nvec, self.validate)
        return ModeCategorical(logits=_masked(out, mask), validate_args=self.validate)

    def mode(self, out: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The distribution's most likely action straight from the layer's output, without building the
        distribution: the argmax of the (masked) logits of each choice, or the Gaussian's mean. Traceable
        (no data-dependent Python), so it is what an exported policy graph holds."""
        space = self.space
        if isinstance(space, Box):
            if mask is not None:
                raise ValueError(f"{space} takes no action mask")
            return out.view(-1, *space.shape)
        if isinstance(space, MultiDiscrete):
            parts = torch.split(_masked(out, mask), list(space.nvec), dim=-1)
            return torch.stack([part.argmax(-1) for part in parts], dim=-1)
        return _masked(out, mask).argmax(-1)

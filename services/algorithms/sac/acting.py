"""SAC's actor side: sample the squashed Gaussian policy; uniformly random actions until the
learner's first update (CleanRL samples the action space before `learning_starts`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from services.algorithms.sac.networks import SquashedGaussianActor
from services.common.models.nets import GreedyPolicy
from services.common.protocol.spaces import Box

if TYPE_CHECKING:
    from services.common.config import CommonConfig
    from services.common.protocol.spaces import EnvSpec
    from services.common.stats import Metrics


class Acting:
    def __init__(self, cfg: CommonConfig, spec: EnvSpec, rng: np.random.Generator, metrics: Metrics):
        self.spec, self.rng = spec, rng
        self.net = SquashedGaussianActor(spec, cfg.section("sac").hidden_sizes)

    @torch.inference_mode()
    def act(self, obs: torch.Tensor, version: int | None, env_steps: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """float32 actions within the Box's bounds. Weights of version 0 (or none yet) are the
        learner's untrained initialisation: the buffer serves no batch before `sac.learning_starts`
        transitions, so until then the replay fills with uniform samples of the space."""
        box = self.spec.action
        assert isinstance(box, Box)   # (SAC takes Box actions only: Algorithm.check_spec)
        if not version:
            return self.rng.uniform(box.low_array, box.high_array, (len(obs), *box.shape)).astype(np.float32), {}
        action, _ = self.net.sample(obs)
        return action.numpy(), {}

    def greedy(self) -> torch.nn.Module:
        """The network's deterministic policy (the squashed Gaussian mean, tanh(mean) * scale + bias),
        for evaluation and export."""
        return GreedyPolicy(self.net, self.spec.action)

"""PPO's actor side: sample from the policy head and record the behaviour log-prob of each action
(the learner's ratio and V-trace need it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from services.algorithms.ppo.networks import ActorCritic
from services.common.models.nets import GreedyPolicy

if TYPE_CHECKING:
    from services.common.config import CommonConfig
    from services.common.protocol.spaces import EnvSpec
    from services.common.stats import Metrics


class Acting:
    def __init__(self, cfg: CommonConfig, spec: EnvSpec, rng: np.random.Generator, metrics: Metrics):
        self.spec = spec
        self.net = ActorCritic(spec, cfg.section("ppo").hidden_sizes, cfg.section("ppo").normalize_observations, cfg.section("ppo").obs_clip)

    @torch.inference_mode()
    def act(self, obs: torch.Tensor, version: int | None, env_steps: int, mask: torch.Tensor | None = None
            ) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Actions in the space's layout (a Box sample unclipped) and their log-probs; disallowed
        actions (`mask` False) are never sampled."""
        dist = self.net.dist(obs, mask)
        action = dist.sample()
        return action.numpy(), {"behaviour_logprob": dist.log_prob(action).numpy()}

    def greedy(self) -> torch.nn.Module:
        """The network's deterministic policy (the most likely action: argmax of the logits, or the
        Gaussian's mean clipped into the Box), for evaluation and export."""
        return GreedyPolicy(self.net, self.spec.action)

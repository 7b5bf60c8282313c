"""PPO's actor side: sample from the policy head and record the behaviour log-prob of each action
(the learner's ratio and V-trace need it). With a recurrent core (ppo.recurrent) the caller keeps each
env's state (`state_size` floats) and hands it in with the observations; `act` returns the state after
the step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from services.algorithms.ppo.networks import RecurrentActorCritic, make_net
from services.common.models.nets import GreedyPolicy

if TYPE_CHECKING:
    from services.common.config import CommonConfig
    from services.common.protocol.spaces import EnvSpec
    from services.common.stats import Metrics


class Acting:
    def __init__(self, cfg: CommonConfig, spec: EnvSpec, rng: np.random.Generator, metrics: Metrics):
        self.spec = spec
        self.net = make_net(spec, cfg.section("ppo"))
        self.state_size = self.net.state_size if isinstance(self.net, RecurrentActorCritic) else 0

    @torch.inference_mode()
    def act(self, obs: torch.Tensor, version: int | None, env_steps: int, mask: torch.Tensor | None = None,
            state: np.ndarray | None = None
            ) -> tuple[np.ndarray, dict[str, np.ndarray]] | tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
        """Actions in the space's layout (a Box sample unclipped) and their log-probs; disallowed
        actions (`mask` False) are never sampled. With a recurrent core, `state` [N, state_size] is
        each env's state before `obs`, and the state after is returned third."""
        if isinstance(self.net, RecurrentActorCritic):
            assert state is not None, "a recurrent policy acts from each env's state"
            out, after = self.net.step(obs, torch.from_numpy(state))
            dist, _ = self.net.heads(out, mask)
            action = dist.sample()
            return action.numpy(), {"behaviour_logprob": dist.log_prob(action).numpy()}, after.numpy()
        dist = self.net.dist(obs, mask)
        action = dist.sample()
        return action.numpy(), {"behaviour_logprob": dist.log_prob(action).numpy()}

    def greedy(self) -> torch.nn.Module:
        """The network's deterministic policy (the most likely action: argmax of the logits, or the
        Gaussian's mean clipped into the Box), for evaluation and export. Recurrent: a module
        (obs, state[, mask]) -> (actions, state after)."""
        if isinstance(self.net, RecurrentActorCritic):
            return GreedyRecurrent(self.net, self.spec.action)
        return GreedyPolicy(self.net, self.spec.action)


class GreedyRecurrent(GreedyPolicy):
    """A recurrent network's deterministic actions (`RecurrentActorCritic.mode`) with the state as an
    explicit input and output, Box actions clipped into bounds as `GreedyPolicy` clips them: what
    `kuberl eval` steps and `kuberl export` writes."""

    def forward(self, obs: torch.Tensor, state: torch.Tensor,  # type: ignore[override]
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        action, after = self.net.mode(obs, state, mask)
        return self.bound(action), after

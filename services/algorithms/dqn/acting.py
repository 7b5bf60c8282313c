"""DQN's actor side: epsilon-greedy over the Q-network, epsilon annealed by the run's progress."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from services.algorithms.dqn.networks import QNetwork
from services.common.models.nets import GreedyPolicy

if TYPE_CHECKING:
    from services.common.config import CommonConfig
    from services.common.protocol.spaces import EnvSpec
    from services.common.stats import Metrics


def epsilon_at(step: int, start: float, end: float, duration: int) -> float:
    """Linear epsilon schedule (CleanRL's linear_schedule) over `duration` env steps."""
    return max(end, start + (end - start) * step / duration)


def run_env_steps(version: int | None, learning_starts: int, batch_size: int, replay_ratio: float) -> int:
    """The run's env steps so far, as implied by a DQN policy version: the learner starts after
    `learning_starts` samples and then takes one gradient step per `batch_size / replay_ratio` samples
    inserted (the buffer paces it to that). An actor started late, e.g. by the planner, anneals epsilon
    by this, so it does not begin at start_epsilon and flood the replay with random transitions.
    An unpaced learner (replay_ratio 0) says nothing beyond having started: `learning_starts`."""
    if not version:
        return 0
    if replay_ratio <= 0:
        return learning_starts
    return int(learning_starts + version * batch_size / replay_ratio)


class Acting:
    def __init__(self, cfg: CommonConfig, spec: EnvSpec, rng: np.random.Generator, metrics: Metrics):
        self.cfg, self.spec, self.rng, self.metrics = cfg.section("dqn"), spec, rng, metrics
        self.net = QNetwork(spec, cfg.section("dqn").hidden_sizes)

    @torch.inference_mode()
    def act(self, obs: torch.Tensor, version: int | None, env_steps: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """Epsilon-greedy actions, epsilon annealed over the larger of this actor's `env_steps` and the
        run's (see run_env_steps)."""
        d = self.cfg
        steps = max(env_steps, run_env_steps(version, d.learning_starts, d.batch_size, d.replay_ratio))
        eps = epsilon_at(steps, d.start_epsilon, d.end_epsilon, d.exploration_steps)
        self.metrics.set("actor/epsilon", eps)
        action = self.net(obs).argmax(dim=1).numpy()
        explore = self.rng.random(len(action)) < eps
        action[explore] = self.rng.integers(0, self.spec.num_actions, int(explore.sum()))
        return action, {}

    def greedy(self) -> torch.nn.Module:
        """The network's deterministic policy (argmax of Q, no exploration), for evaluation and export."""
        return GreedyPolicy(self.net, self.spec.action)

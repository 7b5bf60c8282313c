"""The actor's copy of the policy: a newest-wins weights handoff and batched action selection.

Shared by local envs (rollout.py) and external simulator sessions (sessions.py). `offer_weights`
may be called from any thread; `swap` and `act` run on the one thread that does inference, so a
version is swapped in only between two `act` calls.
"""

from __future__ import annotations

import threading

import numpy as np
import torch

from services.common.config import ExperimentConfig
from services.common.nets import EnvSpec, build_network, load_numpy
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


class Policy:
    def __init__(self, cfg: ExperimentConfig, spec: EnvSpec, seed: int, metrics: Metrics):
        torch.manual_seed(seed)
        self.cfg, self.spec, self.metrics = cfg, spec, metrics
        self.net = build_network(cfg.algorithm, spec, cfg.hidden_sizes)
        self.net.eval()
        self.rng = np.random.default_rng(seed)
        self.version: int | None = None  # None until the learner's first weights arrive
        self.have_weights = threading.Event()
        self._pending: tuple[int, dict] | None = None

    def offer_weights(self, version: int, arrays: dict[str, np.ndarray]) -> None:
        """Hand over new weights (any thread); loaded at the next `swap`. Newest offer wins."""
        self._pending = (version, arrays)  # one atomic reference assignment
        self.have_weights.set()

    def swap(self) -> None:
        """Load the newest offered weights, if any (inference thread only)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            version, arrays = pending
            load_numpy(self.net, arrays)
            self.version = version
            self.metrics.set("actor/policy_version", version)
            self.metrics.inc("actor/weights_swapped_total")

    @torch.inference_mode()
    def act(self, obs: np.ndarray, env_steps: int = 0) -> tuple[np.ndarray, np.ndarray | None]:
        """Actions for a batch of observations, and their log-probs (PPO) or None (DQN, epsilon-greedy
        with epsilon annealed over the larger of this actor's `env_steps` and the run's, see run_env_steps)."""
        x = torch.from_numpy(np.ascontiguousarray(obs))
        if self.cfg.algorithm == "ppo":
            dist = self.net.dist(x)
            action = dist.sample()
            return action.numpy(), dist.log_prob(action).numpy()
        d = self.cfg.dqn
        steps = max(env_steps, run_env_steps(self.version, d.learning_starts, d.batch_size, d.replay_ratio))
        eps = epsilon_at(steps, d.start_epsilon, d.end_epsilon, d.exploration_steps)
        self.metrics.set("actor/epsilon", eps)
        action = self.net(x).argmax(dim=1).numpy()
        explore = self.rng.random(len(action)) < eps
        action[explore] = self.rng.integers(0, self.spec.num_actions, int(explore.sum()))
        return action, None

"""DQN's settings: the `dqn` section of the experiment config."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.settings import require
from services.algorithms.base import check_replay


@dataclass(frozen=True)
class DQNConfig:
    """Double DQN with a target network, as in CleanRL's dqn.py; uniform replay in the buffer."""
    rollout_steps: int = 16           # T: steps per env in one fragment
    buffer_size: int = 50_000         # replay capacity in transitions
    batch_size: int = 128             # transitions per update
    # rl-baselines3-zoo's Acrobot and LunarLander settings (one update of 128 per env step, 256x256,
    # 6.3e-4): bench/zoo.py measured Acrobot at 30.5k env steps to -100 against SB3's 38.1k, where the
    # earlier defaults (a ratio of 8, 128x128, 1e-3) had not reached it in 100k (docs/benchmarks.md).
    learning_rate: float = 6.3e-4     # Adam's step size
    gamma: float = 0.99               # discount factor
    target_update_interval: int = 250  # updates between target-network syncs
    tau: float = 1.0                  # 1.0 = hard copy
    learning_starts: int = 1000       # transitions stored before the buffer serves batches
    # N-step returns (services/buffer/replay.py): each transition sums up to n_step rewards and
    # bootstraps from the observation n_step steps on, within a fragment and an episode.
    n_step: int = 3                   # rewards summed per transition (N-step returns; 1..rollout_steps)
    # Target replay ratio: transitions trained on per transition inserted after learning_starts. The
    # buffer's rate limiter (docs/rate-limiter.md) holds back batches from a learner that runs ahead of
    # production, and holds actors (and simulators' replies) that run ahead of the learner. 0 = unpaced.
    replay_ratio: float = 128.0       # transitions trained on per transition inserted after learning_starts (0 = unpaced)
    replay_ratio_tolerance: float = 0.1  # the band is target * (1 +- tolerance)
    start_epsilon: float = 1.0        # epsilon-greedy: the probability of a random action at the start
    end_epsilon: float = 0.05         # epsilon once exploration_steps are done
    exploration_steps: int = 10_000   # env steps (per actor) to anneal epsilon over
    double_dqn: bool = True           # Double DQN targets (van Hasselt et al. 2016): the online network picks the next
    #                                   action
    max_grad_norm: float = 10.0       # gradients are clipped to this global L2 norm
    hidden_sizes: tuple[int, ...] = (256, 256)  # hidden layer widths of the Q-network's MLP (flat observations)

    def __post_init__(self) -> None:
        require(1 <= self.rollout_steps <= 65536, "rollout_steps", self.rollout_steps, "must be 1..65536")
        require(self.learning_rate > 0, "learning_rate", self.learning_rate, "must be > 0")
        require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        require(self.target_update_interval >= 1, "target_update_interval", self.target_update_interval,
                "must be >= 1")
        require(0 < self.tau <= 1, "tau", self.tau, "must be in (0, 1]")
        require(1 <= self.n_step <= self.rollout_steps, "n_step", self.n_step,
                f"must be 1..rollout_steps ({self.rollout_steps}): returns are summed within a fragment")
        check_replay(self)
        for name in ("start_epsilon", "end_epsilon"):
            require(0 <= getattr(self, name) <= 1, name, getattr(self, name), "must be in [0, 1]")
        require(self.exploration_steps >= 1, "exploration_steps", self.exploration_steps, "must be >= 1")
        require(self.max_grad_norm > 0, "max_grad_norm", self.max_grad_norm, "must be > 0")
        require(all(h > 0 for h in self.hidden_sizes), "hidden_sizes", self.hidden_sizes,
                "every layer needs a positive width")

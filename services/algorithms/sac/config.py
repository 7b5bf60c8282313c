"""SAC's settings: the `sac` section of the experiment config."""

from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.settings import require
from services.algorithms.base import check_replay


@dataclass(frozen=True)
class SACConfig:
    """Soft actor-critic (Haarnoja et al. 2018, "Soft Actor-Critic Algorithms and Applications"): twin
    Q-networks with Polyak-averaged targets, a tanh-squashed Gaussian policy, automatic entropy
    tuning; uniform replay in the buffer, paced at `replay_ratio` as DQN's is. Defaults after CleanRL's
    sac_continuous_action.py (one update of 256 per env step: a replay ratio of 256), with a shorter
    warm-up (bench/zoo.py: 5000 random steps took Pendulum 1.70x SB3's env steps to -200, 1000 took 0.97x)."""
    rollout_steps: int = 8            # T: steps per env in one fragment
    buffer_size: int = 1_000_000      # replay capacity in transitions
    batch_size: int = 256             # transitions per update
    learning_starts: int = 1000       # transitions stored before the buffer serves batches; until the
                                      # learner's first update actors act uniformly at random
    replay_ratio: float = 256.0       # transitions trained on per transition inserted (0 = unpaced)
    replay_ratio_tolerance: float = 0.1  # the band is target * (1 +- tolerance)
    gamma: float = 0.99               # discount factor
    tau: float = 0.005                # Polyak step of the target critics after every update
    policy_lr: float = 3e-4           # the policy's Adam step size
    q_lr: float = 1e-3                # the critics' Adam step size (and alpha's, with autotune)
    alpha: float = 0.2                # entropy temperature: the initial value when autotune is on
    autotune: bool = True             # learn alpha towards target_entropy
    target_entropy: float | None = None  # None: -(action dimensions), the paper's heuristic
    hidden_sizes: tuple[int, ...] = (256, 256)  # hidden layer widths of the policy and critic MLPs

    def __post_init__(self) -> None:
        require(1 <= self.rollout_steps <= 65536, "rollout_steps", self.rollout_steps, "must be 1..65536")
        check_replay(self)
        require(0 <= self.gamma <= 1, "gamma", self.gamma, "must be in [0, 1]")
        require(0 < self.tau <= 1, "tau", self.tau, "must be in (0, 1]")
        for name in ("policy_lr", "q_lr", "alpha"):
            require(math.isfinite(getattr(self, name)) and getattr(self, name) > 0, name, getattr(self, name),
                    "must be a finite number > 0")
        require(self.target_entropy is None or math.isfinite(self.target_entropy), "target_entropy",
                self.target_entropy, "must be a finite number, or left out for -(action dimensions)")
        require(all(h > 0 for h in self.hidden_sizes), "hidden_sizes", self.hidden_sizes,
                "every layer needs a positive width")

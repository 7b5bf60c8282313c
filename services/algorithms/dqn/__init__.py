"""Double DQN (van Hasselt et al. 2016): transitions in a uniform replay, served at a replay ratio
the buffer paces; epsilon-greedy actors (acting.py, learner.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kuberl.v1 import common_pb2 as pb
from services.algorithms.base import Algorithm, ReplayTable
from services.algorithms.dqn.config import DQNConfig
from services.common.protocol.spaces import Discrete

if TYPE_CHECKING:
    from services.common.config import CommonConfig


class DQN(Algorithm[DQNConfig]):
    name = "dqn"
    settings = DQNConfig
    code = pb.ALGORITHM_DQN
    action_spaces = (Discrete,)
    per_policy = ("learning_rate", "batch_size", "gamma", "target_update_interval", "tau", "double_dqn",
                  "max_grad_norm")

    def table(self, cfg: CommonConfig) -> ReplayTable:
        d = self.section(cfg)
        return ReplayTable(d.buffer_size, d.learning_starts, d.replay_ratio, d.replay_ratio_tolerance,
                           n_step=d.n_step, gamma=d.gamma)

    def batch_size(self, cfg: CommonConfig) -> int:
        return self.section(cfg).batch_size

    def consumption_ratio(self, cfg: CommonConfig) -> float:
        return self.section(cfg).replay_ratio

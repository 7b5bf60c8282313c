"""PPO (Schulman et al. 2017): on-policy fragments with the behaviour log-probs, served once from
a FIFO; V-trace corrects fragments that arrive stale (acting.py, learner.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kuberl.v1 import common_pb2 as pb
from services.algorithms.base import Algorithm, FifoTable
from services.algorithms.ppo.config import PPOConfig
from services.common.protocol.spaces import Box, Discrete, MultiDiscrete

if TYPE_CHECKING:
    from services.common.config import CommonConfig


class PPO(Algorithm[PPOConfig]):
    name = "ppo"
    settings = PPOConfig
    code = pb.ALGORITHM_PPO
    fragment_extras = ("behaviour_logprob",)
    action_spaces = (Discrete, MultiDiscrete, Box)
    takes_action_masks = True

    def table(self, cfg: CommonConfig) -> FifoTable:
        ppo = self.section(cfg)
        return FifoTable(cfg.buffer.fifo_capacity_steps, ppo.max_policy_lag, ppo.stale_fragments)

    def batch_size(self, cfg: CommonConfig) -> int:
        return self.section(cfg).batch_steps

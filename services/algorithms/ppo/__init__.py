"""PPO (Schulman et al. 2017): on-policy fragments with the behaviour log-probs, served once from
a FIFO; V-trace corrects fragments that arrive stale (acting.py, learner.py)."""

from __future__ import annotations

from kuberl.v1 import common_pb2 as pb
from services.algorithms.base import Algorithm, FifoTable
from services.common.spaces import Box, Discrete, MultiDiscrete


class PPO(Algorithm):
    name = "ppo"
    code = pb.ALGORITHM_PPO
    fragment_extras = ("behaviour_logprob",)
    action_spaces = (Discrete, MultiDiscrete, Box)
    takes_action_masks = True

    def table(self, cfg) -> FifoTable:
        return FifoTable(cfg.buffer.fifo_capacity_steps, cfg.ppo.max_policy_lag, cfg.ppo.stale_fragments)

    def batch_size(self, cfg) -> int:
        return cfg.ppo.batch_steps

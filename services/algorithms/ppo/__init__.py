"""PPO (Schulman et al. 2017): on-policy fragments with the behaviour log-probs, served once from
a FIFO; V-trace corrects fragments that arrive stale (acting.py, learner.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kuberl.v1 import common_pb2 as pb
from services.algorithms.base import Algorithm, Extras, FifoTable
from services.algorithms.ppo.config import PPOConfig
from services.common.protocol.spaces import Box, Discrete, MultiDiscrete

if TYPE_CHECKING:
    from services.common.config import CommonConfig


# With a recurrent core (ppo.recurrent): each env's state at a fragment's first step, float32
# [N, state_size], from which the learner replays the fragment (docs/recurrent.md).
STATE_EXTRA = "core_state"


class PPO(Algorithm[PPOConfig]):
    name = "ppo"
    settings = PPOConfig
    code = pb.ALGORITHM_PPO
    fragment_extras = ("behaviour_logprob",)
    action_spaces = (Discrete, MultiDiscrete, Box)
    takes_action_masks = True
    per_policy = ("learning_rate", "ent_coef", "vf_coef", "clip_coef", "clip_vloss", "norm_adv", "max_grad_norm",
                  "num_epochs", "num_minibatches", "batch_steps", "gamma", "gae_lambda", "anneal_updates",
                  "anneal_clip")

    def extras(self, cfg: CommonConfig) -> Extras:
        """The behaviour log-probs; with a recurrent core (ppo.recurrent) also each env's core state
        at the fragment's first step."""
        return Extras(self.fragment_extras, (STATE_EXTRA,) if self.section(cfg).recurrent else ())

    def table(self, cfg: CommonConfig) -> FifoTable:
        ppo = self.section(cfg)
        return FifoTable(cfg.buffer.fifo_capacity_steps, ppo.max_policy_lag, ppo.stale_fragments)

    def batch_size(self, cfg: CommonConfig) -> int:
        return self.section(cfg).batch_steps

"""Double DQN with a target network (van Hasselt et al. 2016), after CleanRL's dqn.py.

The learner's version is the number of gradient updates. Batches come from the buffer's uniform
replay as numpy arrays (see TransitionBatch). `Learner` is the seam's entry point (services/algorithms).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from services.algorithms.group import GroupSync, average_over_group, finite_gradients
from services.algorithms.checks import TransitionLearner, skipped_step
from services.algorithms.dqn.config import DQNConfig
from services.algorithms.dqn.networks import QNetwork
from services.common.models.nets import EnvSpec, resolve_device
from services.common.stats import Metrics


def td_target(rewards: torch.Tensor, terminated: torch.Tensor, next_q_online: torch.Tensor,
              next_q_target: torch.Tensor, gamma: float | torch.Tensor, double: bool) -> torch.Tensor:
    """y = r + gamma * (1 - terminated) * Q_target(s', a*), with a* = argmax_a Q_online(s', a) for
    double DQN, or a* = argmax_a Q_target(s', a) for plain DQN. With n-step returns `rewards` are
    their sums and `gamma` is each transition's own gamma^k (the batch's `discount`)."""
    best = (next_q_online if double else next_q_target).argmax(dim=1, keepdim=True)
    next_value = next_q_target.gather(1, best).squeeze(1)
    return rewards + gamma * next_value * (1.0 - terminated.float())


class DQN(TransitionLearner):
    def __init__(self, cfg: DQNConfig, spec: EnvSpec, device: str = "cpu", sync: GroupSync | None = None,
                 metrics: Metrics | None = None):
        self.cfg, self.spec, self.device, self.sync = cfg, spec, resolve_device(device), sync
        self.metrics = metrics or Metrics("learner")
        self.lag = self.metrics.histogram("learner/policy_lag")
        self.q = QNetwork(spec, cfg.hidden_sizes).to(self.device)
        self.target = copy.deepcopy(self.q)
        self.optimizer = torch.optim.Adam(self.q.parameters(), lr=cfg.learning_rate)
        self.version = 0

    @property
    def policy(self) -> torch.nn.Module:
        """The module actors run."""
        return self.q

    def update(self, batch: dict[str, np.ndarray] | None) -> dict[str, float]:
        """One gradient step on a TransitionBatch (numpy arrays); returns scalar diagnostics. In a group of
        learners the gradient is averaged over the group first; `batch=None` joins that average with
        nothing (this learner had no usable batch this round). A step whose loss or (averaged) gradient
        is not finite is not taken, on every learner of the group alike, and the version stays."""
        self.optimizer.zero_grad(set_to_none=True)
        stats: dict[str, float] = {}
        loss = None
        if batch is not None:
            t = {k: torch.tensor(v, device=self.device) for k, v in batch.items()}  # copies read-only wire arrays
            with torch.no_grad():
                next_q_target = self.target(t["next_obs"])
                next_q_online = self.q(t["next_obs"]) if self.cfg.double_dqn else next_q_target
                y = td_target(t["rewards"], t["terminated"], next_q_online, next_q_target,
                              t.get("discount", self.cfg.gamma), self.cfg.double_dqn)
            q_sa = self.q(t["obs"]).gather(1, t["actions"].long().view(-1, 1)).squeeze(1)
            loss = F.smooth_l1_loss(q_sa, y)
            loss.backward()
            stats = {"loss": loss.item(), "q_mean": q_sa.mean().item()}
        weight = float(len(batch["obs"])) if batch is not None else 0.0
        params = list(self.q.parameters())
        if average_over_group(self.sync, params, weight, loss) == 0:
            return stats  # nobody in the group had data: no step, on every learner alike
        if not finite_gradients(params):
            skipped_step(self.metrics, "dqn", self.version)
            return stats
        stats["grad_norm"] = float(torch.nn.utils.clip_grad_norm_(self.q.parameters(), self.cfg.max_grad_norm))
        self.optimizer.step()
        self.version += 1
        if self.version % self.cfg.target_update_interval == 0:
            with torch.no_grad():  # tau = 1 is the hard copy of the Nature DQN
                for tp, p in zip(self.target.parameters(), self.q.parameters()):
                    tp.lerp_(p, self.cfg.tau)
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {"q": self.q.state_dict(), "target": self.target.state_dict(),
                "optimizer": self.optimizer.state_dict(), "version": self.version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.q.load_state_dict(state["q"])
        self.target.load_state_dict(state["target"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])


Learner = DQN

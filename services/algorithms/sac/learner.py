"""Soft actor-critic (Haarnoja et al. 2018) with automatic entropy tuning, after CleanRL's
sac_continuous_action.py: twin Q critics and Polyak-averaged targets, a tanh-squashed Gaussian policy
(networks.py), one critic step then one policy and temperature step per update (SB3's schedule).

The learner's version is the number of updates. Batches come from the buffer's uniform replay, paced
at `sac.replay_ratio` (see TransitionBatch). In a group of learners both steps average their
gradients over the group, each in its own round. `Learner` is the seam's entry point.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from services.algorithms.group import GroupSync, average_over_group, finite_gradients
from services.algorithms.checks import TransitionLearner, skipped_step
from services.algorithms.sac.networks import SquashedGaussianActor, TwinQ
from services.algorithms.sac.config import SACConfig
from services.common.models.nets import EnvSpec, resolve_device
from services.common.stats import Metrics


def critic_target(rewards: torch.Tensor, terminated: torch.Tensor, next_q1: torch.Tensor, next_q2: torch.Tensor,
                  next_logp: torch.Tensor, alpha: torch.Tensor | float, gamma: torch.Tensor | float) -> torch.Tensor:
    """y = r + gamma * (1 - terminated) * (min(Q1', Q2')(s', a') - alpha * log pi(a'|s')), a' ~ pi(s')."""
    soft_value = torch.min(next_q1, next_q2) - alpha * next_logp
    return rewards + gamma * (1.0 - terminated.float()) * soft_value


def actor_loss(logp: torch.Tensor, q1: torch.Tensor, q2: torch.Tensor, alpha: torch.Tensor | float) -> torch.Tensor:
    """E[alpha * log pi(a|s) - min(Q1, Q2)(s, a)], a ~ pi(s) reparameterised."""
    return (alpha * logp - torch.min(q1, q2)).mean()


def alpha_loss(log_alpha: torch.Tensor, logp: torch.Tensor, target_entropy: float) -> torch.Tensor:
    """E[-alpha * (log pi(a|s) + target entropy)]: raises alpha while the policy's entropy is below the
    target, lowers it above (CleanRL's form, in alpha = exp(log_alpha))."""
    return (-log_alpha.exp() * (logp.detach() + target_entropy)).mean()


class SAC(TransitionLearner):
    def __init__(self, cfg: SACConfig, spec: EnvSpec, device: str = "cpu", sync: GroupSync | None = None,
                 metrics: Metrics | None = None):
        self.cfg, self.spec, self.device, self.sync = cfg, spec, resolve_device(device), sync
        self.metrics = metrics or Metrics("learner")
        self.lag = self.metrics.histogram("learner/policy_lag")
        self.actor = SquashedGaussianActor(spec, cfg.hidden_sizes).to(self.device)
        self.actor.validate = False  # a non-finite output: a non-finite loss, its step skipped (not a crash)
        self.critic = TwinQ(spec, cfg.hidden_sizes).to(self.device)
        self.target = copy.deepcopy(self.critic).requires_grad_(False)
        self.q_optimizer = torch.optim.Adam(self.critic.parameters(), lr=cfg.q_lr)
        self.pi_optimizer = torch.optim.Adam(self.actor.parameters(), lr=cfg.policy_lr)
        self.log_alpha = torch.nn.Parameter(torch.tensor(math.log(cfg.alpha), device=self.device),
                                            requires_grad=cfg.autotune)
        self.alpha_optimizer = torch.optim.Adam([self.log_alpha], lr=cfg.q_lr) if cfg.autotune else None
        self.target_entropy = (cfg.target_entropy if cfg.target_entropy is not None
                               else -float(np.prod(spec.action.shape)))
        self.version = 0

    @property
    def policy(self) -> torch.nn.Module:
        """The module actors run: the policy alone (the critics stay on the learner)."""
        return self.actor

    def update(self, batch: dict[str, np.ndarray] | None) -> dict[str, float]:
        """One critic step, then one policy (and temperature) step, on a TransitionBatch (numpy arrays);
        returns scalar diagnostics. `batch=None` joins a group's rounds with nothing.

        A step whose loss or (averaged) gradient is not finite is not taken, on every learner of the
        group alike, and the update ends there with its version not advanced: a critic step skipped
        skips everything; a policy step skipped leaves the critic's step taken, but not the temperature's,
        the targets' or the version's."""
        stats: dict[str, float] = {}
        q_loss = policy_losses = None  # (None: no data here)
        t = None if batch is None else {k: torch.tensor(v, device=self.device) for k, v in batch.items()}
        weight = float(len(batch["obs"])) if batch is not None else 0.0
        alpha = self.log_alpha.detach().exp()

        self.q_optimizer.zero_grad(set_to_none=True)
        if t is not None:
            with torch.no_grad():
                next_action, next_logp = self.actor.sample(t["next_obs"])
                next_q1, next_q2 = self.target(t["next_obs"], next_action)
                y = critic_target(t["rewards"], t["terminated"], next_q1, next_q2,
                                  next_logp, alpha, t.get("discount", self.cfg.gamma))
            q1, q2 = self.critic(t["obs"], t["actions"])
            q_loss = F.mse_loss(q1, y) + F.mse_loss(q2, y)
            q_loss.backward()
            stats = {"q_loss": q_loss.item(), "q_mean": q1.mean().item()}
        critic = list(self.critic.parameters())
        if average_over_group(self.sync, critic, weight, q_loss) == 0:
            return stats  # nobody in the group had data: no step, on every learner alike
        if not finite_gradients(critic):
            skipped_step(self.metrics, "sac critic", self.version)
            return stats
        self.q_optimizer.step()

        self.pi_optimizer.zero_grad(set_to_none=True)
        if self.alpha_optimizer is not None:
            self.alpha_optimizer.zero_grad(set_to_none=True)
        if t is not None:
            self.critic.requires_grad_(False)  # the policy's gradient flows through Q's input, not its weights
            try:
                action, logp = self.actor.sample(t["obs"])
                pi_q1, pi_q2 = self.critic(t["obs"], action)
                pi_loss = actor_loss(logp, pi_q1, pi_q2, alpha)
                pi_loss.backward()
            finally:
                self.critic.requires_grad_(True)
            stats.update(pi_loss=pi_loss.item(), entropy=-logp.mean().item())
            policy_losses = pi_loss.detach()
            if self.alpha_optimizer is not None:
                a_loss = alpha_loss(self.log_alpha, logp, self.target_entropy)
                a_loss.backward()
                policy_losses = torch.stack([policy_losses, a_loss.detach()])
        params = list(self.actor.parameters()) + ([self.log_alpha] if self.alpha_optimizer is not None else [])
        average_over_group(self.sync, params, weight, policy_losses)
        if not finite_gradients(params):
            skipped_step(self.metrics, "sac policy", self.version)
            return stats
        self.pi_optimizer.step()
        if self.alpha_optimizer is not None:
            self.alpha_optimizer.step()
        with torch.no_grad():
            for tp, p in zip(self.target.parameters(), self.critic.parameters()):
                tp.lerp_(p, self.cfg.tau)
        self.version += 1
        stats["alpha"] = float(self.log_alpha.detach().exp())
        return stats

    def state_dict(self) -> dict[str, Any]:
        return {"actor": self.actor.state_dict(), "critic": self.critic.state_dict(),
                "target": self.target.state_dict(), "log_alpha": self.log_alpha.detach().clone(),
                "q_optimizer": self.q_optimizer.state_dict(), "pi_optimizer": self.pi_optimizer.state_dict(),
                "alpha_optimizer": None if self.alpha_optimizer is None else self.alpha_optimizer.state_dict(),
                "version": self.version}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.actor.load_state_dict(state["actor"])
        self.critic.load_state_dict(state["critic"])
        self.target.load_state_dict(state["target"])
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        self.q_optimizer.load_state_dict(state["q_optimizer"])
        self.pi_optimizer.load_state_dict(state["pi_optimizer"])
        if self.alpha_optimizer is not None and state["alpha_optimizer"] is not None:
            self.alpha_optimizer.load_state_dict(state["alpha_optimizer"])
        self.version = int(state["version"])


Learner = SAC

"""PPO with the clipped surrogate, clipped value loss and GAE (Schulman et al. 2017), after CleanRL's ppo.py.

A batch is a list of whole fragments. Values (and so advantages) are recomputed with the current
network at the start of each batch, which also gives the bootstrap values V(obs[T]) and V(final_obs)
at truncations. The learner's version is the number of gradient updates (minibatch steps).
"""

from __future__ import annotations

import numpy as np
import torch

from services.common.config import PPOConfig
from services.common.fragments import Fragment
from services.common.nets import ActorCritic, EnvSpec


def gae(rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor, terminated: torch.Tensor,
        dones: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over [T, N] tensors (Schulman et al. 2016, eq. 16).

    next_values[t] is V of the observation after step t (the true final observation where an
    episode ended). `terminated` stops bootstrapping; `dones` (terminated or truncated) stops the
    advantage recursion. Returns (advantages, returns = advantages + values).
    """
    T = rewards.shape[0]
    adv = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[0])
    for t in reversed(range(T)):
        delta = rewards[t] + gamma * next_values[t] * (1.0 - terminated[t].float()) - values[t]
        last = delta + gamma * lam * (1.0 - dones[t].float()) * last
        adv[t] = last
    return adv, adv + values


class PPO:
    def __init__(self, cfg: PPOConfig, spec: EnvSpec, device: str = "cpu"):
        self.cfg, self.device = cfg, torch.device(device)
        self.net = ActorCritic(spec, cfg.hidden_sizes).to(self.device)
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=cfg.learning_rate, eps=1e-5)
        self.version = 0

    @property
    def policy(self) -> torch.nn.Module:
        """The module actors run."""
        return self.net

    def _tensor(self, arr: np.ndarray) -> torch.Tensor:
        return torch.tensor(arr, device=self.device)  # copies: wire arrays are read-only

    @torch.no_grad()
    def _advantages(self, frag: Fragment):
        T, N = frag.num_steps, frag.num_envs
        obs = self._tensor(frag.obs)
        values = self.net.value(obs.flatten(0, 1)).view(T + 1, N)
        next_values = values[1:].clone()
        if len(frag.final_index):
            next_values.view(-1)[self._tensor(frag.final_index)] = self.net.value(self._tensor(frag.final_obs))
        term, trunc = self._tensor(frag.terminated), self._tensor(frag.truncated)
        adv, ret = gae(self._tensor(frag.rewards), values[:-1], next_values, term, term | trunc,
                       self.cfg.gamma, self.cfg.gae_lambda)
        return obs[:-1].flatten(0, 1), values[:-1].reshape(-1), adv.reshape(-1), ret.reshape(-1)

    def update(self, fragments: list[Fragment]) -> dict[str, float]:
        """num_epochs x num_minibatches gradient steps on the fragments; returns scalar diagnostics."""
        c = self.cfg
        parts = [self._advantages(f) for f in fragments]
        obs, values, adv, ret = (torch.cat(x) for x in zip(*parts))
        actions = torch.cat([self._tensor(f.actions).reshape(-1) for f in fragments]).long()
        old_logprob = torch.cat([self._tensor(f.behaviour_logprob).reshape(-1) for f in fragments])
        n = len(actions)
        clipfracs, stats = [], {}
        for _ in range(c.num_epochs):
            # Exactly num_minibatches per epoch, sizes differing by at most one, whatever n is.
            for mb in torch.tensor_split(torch.randperm(n, device=self.device), min(c.num_minibatches, n)):
                dist = self.net.dist(obs[mb])
                logratio = dist.log_prob(actions[mb]) - old_logprob[mb]
                ratio = logratio.exp()
                with torch.no_grad():
                    approx_kl = ((ratio - 1) - logratio).mean()
                    clipfracs.append(((ratio - 1.0).abs() > c.clip_coef).float().mean().item())
                mb_adv = adv[mb]
                if c.norm_adv and len(mb) > 1:
                    mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
                pg_loss = torch.max(-mb_adv * ratio,
                                    -mb_adv * torch.clamp(ratio, 1 - c.clip_coef, 1 + c.clip_coef)).mean()
                new_value = self.net.value(obs[mb])
                if c.clip_vloss:
                    v_clipped = values[mb] + torch.clamp(new_value - values[mb], -c.clip_coef, c.clip_coef)
                    v_loss = 0.5 * torch.max((new_value - ret[mb]) ** 2, (v_clipped - ret[mb]) ** 2).mean()
                else:
                    v_loss = 0.5 * ((new_value - ret[mb]) ** 2).mean()
                entropy = dist.entropy().mean()
                loss = pg_loss - c.ent_coef * entropy + c.vf_coef * v_loss
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self.net.parameters(), c.max_grad_norm)
                self.optimizer.step()
                self.version += 1
        stats.update(policy_loss=pg_loss.item(), value_loss=v_loss.item(), entropy=entropy.item(),
                     approx_kl=approx_kl.item(), clipfrac=float(np.mean(clipfracs)))
        return stats

    def state_dict(self) -> dict:
        return {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), "version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])

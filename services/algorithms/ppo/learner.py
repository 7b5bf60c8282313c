"""PPO with the clipped surrogate, clipped value loss and GAE (Schulman et al. 2017), after CleanRL's ppo.py.

A batch is a list of whole fragments. Values (and so advantages) are recomputed with the current
network at the start of each batch, which also gives the bootstrap values V(obs[T]) and V(final_obs)
at truncations. Fragments marked stale get V-trace targets instead of GAE (Espeholt et al. 2018):
truncated importance weights between the current policy and the behaviour log-probs the actor
recorded. With ppo.decoupled the clip is centred on the policy at the start of the update rather than
on the behaviour policy, each sample weighted by the truncated pi/mu (Hilton et al. 2021), so data an
asynchronous actor stepped a version or two behind does not start its update outside the clip. The
learner's version counts updates as CleanRL does: one per batch (num_epochs x
num_minibatches gradient steps), so a policy lag of k means k batches behind. `Learner` is the seam's
entry point (services/algorithms).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from kuberl.v1 import common_pb2 as pb
from services.algorithms.group import GroupSync, average_over_group, finite_gradients
from services.algorithms.checks import check_fits, skipped_step
from services.algorithms.ppo import PPO as PPOAlgorithm, STATE_EXTRA
from services.algorithms.ppo.config import PPOConfig
from services.common.protocol.fragments import Fragment, decode_fragment
from services.common.protocol.tensors import TensorError
from services.algorithms.ppo.networks import ActorCritic, RecurrentActorCritic, make_net
from services.common.models.heads import ActionDist
from services.common.models.nets import EnvSpec, ObsNormalizer, resolve_device
from services.common.stats import Metrics


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


def vtrace(rewards: torch.Tensor, values: torch.Tensor, next_values: torch.Tensor, terminated: torch.Tensor,
           dones: torch.Tensor, log_rhos: torch.Tensor, gamma: float, lam: float, rho_bar: float,
           c_bar: float) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace over [T, N] tensors (Espeholt et al. 2018, eq. 1 and section 4.2), with lambda.

    rho_t = min(rho_bar, pi/mu), c_t = lam * min(c_bar, pi/mu), log_rhos = log pi - log mu.
    v_s = V(x_s) + sum_t gamma^(t-s) (prod_{i<t} c_i) rho_t delta_t, delta_t = r_t + gamma V(x_{t+1}) - V(x_t),
    cut at episode ends. Returns (policy-gradient advantages rho_s (r_s + gamma v_{s+1} - V(x_s)), targets v_s).
    """
    rhos = log_rhos.exp()
    clipped_rhos = rhos.clamp(max=rho_bar)
    cs = lam * rhos.clamp(max=c_bar)
    not_term = 1.0 - terminated.float()
    not_done = 1.0 - dones.float()
    deltas = clipped_rhos * (rewards + gamma * next_values * not_term - values)
    vs_minus_v = torch.zeros_like(values)
    acc = torch.zeros_like(values[0])
    for t in reversed(range(rewards.shape[0])):
        acc = deltas[t] + gamma * cs[t] * not_done[t] * acc
        vs_minus_v[t] = acc
    vs = values + vs_minus_v
    # v_{s+1}: the next target inside an episode; the bootstrap value at its end or the fragment's.
    next_vs = next_values.clone()
    next_vs[:-1] = torch.where(dones[:-1].bool(), next_values[:-1], vs[1:])
    return clipped_rhos * (rewards + gamma * next_vs * not_term - values), vs


MAX_RETURN_STREAMS = 65536  # envs whose running discounted return is kept, least recently updated forgotten


class RewardNormalizer:
    """ppo.normalize_rewards: rewards divided by the running standard deviation of the discounted
    return, clipped (SB3's VecNormalize norm_reward). Each env of each actor process, (actor_id,
    incarnation, env_id), keeps its running return r_0 + g r_1 + ... across fragments, restarted at
    every episode end; every step's return goes into the statistics (summed over a learner group
    first, like the observation statistics), which checkpoints carry."""

    def __init__(self, gamma: float, clip: float, device: torch.device | str):
        self.gamma, self.clip = gamma, clip
        self.stats = ObsNormalizer(1, clip=clip).to(device)
        self.running: OrderedDict[tuple[str, int, int], float] = OrderedDict()

    def returns(self, frag: Fragment) -> np.ndarray:
        """[T, N] running discounted returns of `frag`'s steps, going on from each env's last fragment."""
        keys = [(frag.actor_id, frag.incarnation, env) for env in frag.env_ids]
        ret = np.array([self.running.pop(k, 0.0) for k in keys], np.float64)
        out = np.empty(frag.rewards.shape, np.float64)
        ended = frag.terminated | frag.truncated
        for t in range(frag.num_steps):
            ret = ret * self.gamma + frag.rewards[t]
            out[t] = ret
            ret[ended[t]] = 0.0
        for k, r in zip(keys, ret.tolist()):
            self.running[k] = r
        while len(self.running) > MAX_RETURN_STREAMS:
            self.running.popitem(last=False)
        return out

    def scale(self, rewards: torch.Tensor) -> torch.Tensor:
        std = (self.stats.var + self.stats.eps).sqrt().to(rewards.dtype)
        return (rewards / std).clamp(-self.clip, self.clip)


# A batch's rows: (obs, values, advantages, returns, actions, the log-probs the clip is centred on (the
# behaviour policy's, or the current one's with ppo.decoupled), importance weights or None, masks or None).
Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None,
             torch.Tensor | None]


Replayed = tuple[torch.Tensor, ActionDist, torch.Tensor]   # rows, their distributions and values


def starts_afresh(done: torch.Tensor, length: int) -> torch.Tensor:
    """[length, N] bool: the steps of a replayed sequence whose state starts afresh (those after an
    episode's end, `done` [T, N]); never the first, whose recorded state is already reset."""
    resets = torch.zeros((length, done.shape[1]), dtype=torch.bool, device=done.device)
    resets[1:] = done[:length - 1].bool()
    return resets


class Sequences:
    """A batch's env columns as sequences for a recurrent core: each fragment's column n is one
    sequence of T steps from the state the actor recorded (extras.core_state[n]). Sequences of one
    length are stacked so a minibatch replays each length in one `unroll`."""

    def __init__(self, fragments: list[Fragment], device: torch.device):
        by_length: dict[int, list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]] = {}
        offset = 0
        for f in fragments:
            T, N = f.num_steps, f.num_envs
            rows = offset + torch.arange(T * N, device=device).view(T, N)   # (rows are t * N + n per fragment)
            done = torch.as_tensor(f.terminated | f.truncated, device=device)
            by_length.setdefault(T, []).append((rows, torch.tensor(f.extras[STATE_EXTRA], device=device),
                                                starts_afresh(done, T)))
            offset += T * N
        # Per length: rows [T, B], first states [B, S], resets [T, B]
        self.groups = [(torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts]),
                        torch.cat([p[2] for p in parts], 1)) for parts in by_length.values()]
        self.group_of = torch.cat([torch.full((g[0].shape[1],), i, device=device) for i, g in enumerate(self.groups)]
                                  ) if self.groups else torch.zeros(0, dtype=torch.long, device=device)
        self.column_of = torch.cat([torch.arange(g[0].shape[1], device=device) for g in self.groups]
                                   ) if self.groups else torch.zeros(0, dtype=torch.long, device=device)
        self.count = len(self.group_of)

    def replay(self, net: torch.nn.Module, data: Rows, mb: torch.Tensor) -> Replayed:
        """Replay sequences `mb` (indices) through `net` from their recorded states: the rows of
        `data` they cover, with the current policy's distributions and values there."""
        assert isinstance(net, RecurrentActorCritic)
        obs, masks = data[0], data[7]
        outs, rows = [], []
        for g, (g_rows, g_state, g_resets) in enumerate(self.groups):
            cols = self.column_of[mb[self.group_of[mb] == g]]
            if len(cols):
                r = g_rows[:, cols]
                out, _ = net.unroll(obs[r], g_state[cols], g_resets[:, cols])
                outs.append(out.flatten(0, 1))
                rows.append(r.flatten())
        at = torch.cat(rows)
        dist, value = net.heads(torch.cat(outs), None if masks is None else masks[at])
        return at, dist, value


class PPO:
    def __init__(self, cfg: PPOConfig, spec: EnvSpec, device: str = "cpu", sync: GroupSync | None = None,
                 metrics: Metrics | None = None):
        self.cfg, self.spec, self.device, self.sync = cfg, spec, resolve_device(device), sync
        self.metrics = metrics or Metrics("learner")
        self.lag = self.metrics.histogram("learner/policy_lag")
        self.net = make_net(spec, cfg).to(self.device)
        self.recurrent = isinstance(self.net, RecurrentActorCritic)
        self.net.head.validate = False  # a non-finite output: a non-finite loss, its step skipped (not a crash)
        self.optimizer = torch.optim.Adam(self.net.parameters(), lr=cfg.learning_rate, eps=1e-5)
        self.rewards = RewardNormalizer(cfg.gamma, cfg.reward_clip, self.device) if cfg.normalize_rewards else None
        self.version = 0
        self.gradient_steps = 0

    @property
    def policy(self) -> torch.nn.Module:
        """The module actors run."""
        return self.net

    def decode(self, batch: pb.TrainingBatch) -> list[Fragment]:
        """The batch's fragments, validated; raises ValueError (TensorError) naming what does not fit.
        Decoding refuses NaN and infinity in every float field (NonFiniteError, counted apart)."""
        start = (STATE_EXTRA,) if self.recurrent else ()
        frags = [decode_fragment(m, algorithm=pb.ALGORITHM_PPO, extras=PPOAlgorithm.fragment_extras, start_extras=start)
                 for m in batch.rollouts.fragments]
        for f in frags:
            check_fits(self.spec, f.obs.reshape(-1, *f.obs.shape[2:]), f.final_obs, actions=f.actions,
                       lead=(f.num_steps, f.num_envs), mask=f.action_mask)
            if self.recurrent and (got := f.extras[STATE_EXTRA].shape) != (f.num_envs, self.net.state_size):
                raise TensorError(f"extras.{STATE_EXTRA}", f"must be [N={f.num_envs}, {self.net.state_size}] "
                                  f"(ppo.recurrent: {self.cfg.recurrent} of {self.cfg.recurrent_size}), got {list(got)}")
        return frags

    def learn(self, frags: list[Fragment]) -> tuple[int, dict[str, float]] | None:
        """One update on the batch's fragments after the staleness bound: (samples trained on,
        diagnostics), or None when every fragment was too stale (dropped and counted)."""
        frags, correct = self._bound_staleness(frags)
        if not frags:
            return None
        return sum(f.num_samples for f in frags), self.update(frags, correct)

    def empty_update(self) -> None:
        """Take part in a group's update with nothing (weight 0)."""
        self.update([])

    def _bound_staleness(self, frags: list[Fragment]) -> tuple[list[Fragment], list[bool]]:
        """Apply ppo.max_policy_lag at consumption, where the lag is exact: drop (counted) or mark for
        V-trace correction every fragment more than max_policy_lag versions behind."""
        p = self.cfg
        lags = [self.version - f.policy_version for f in frags]
        self.lag.observe(lags, [f.num_samples for f in frags])
        stale = [p.max_policy_lag is not None and lag > p.max_policy_lag for lag in lags]
        if p.stale_fragments == "correct":
            self.metrics.inc("learner/fragments_corrected_total", sum(stale))
            return frags, stale
        for f, is_stale in zip(frags, stale):
            if is_stale:
                self.metrics.inc("learner/fragments_dropped_stale_total")
                self.metrics.inc("learner/samples_dropped_stale_total", f.num_samples)
        return [f for f, is_stale in zip(frags, stale) if not is_stale], [False] * (len(frags) - sum(stale))

    def _tensor(self, arr: np.ndarray) -> torch.Tensor:
        return torch.tensor(arr, device=self.device)  # copies: wire arrays are read-only

    def _actions(self, frag: Fragment) -> torch.Tensor:
        """[T*N, *action_shape]: integer actions as int64, Box actions as float32."""
        return self._tensor(frag.actions).reshape(frag.num_samples, *frag.actions.shape[2:])

    def _mask(self, frag: Fragment, masked: bool) -> torch.Tensor | None:
        """[T*N, M] allowed actions: the fragment's, all-True for an unmasked fragment in a masked
        batch, None where nothing in the batch is masked."""
        if not masked:
            return None
        if frag.action_mask is None:
            return torch.ones((frag.num_samples, self.spec.action.mask_width), dtype=torch.bool, device=self.device)
        return self._tensor(frag.action_mask).reshape(frag.num_samples, -1)

    @torch.no_grad()
    def _advantages(self, frag: Fragment, correct: bool, mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(obs, values, advantages, returns) of the fragment's T*N samples, then the log-probs its
        clip is centred on and its importance weights (None: all 1): the behaviour log-probs, or with
        ppo.decoupled the current policy's and the truncated weight pi/mu (1 where V-trace has put it
        into the advantages already)."""
        c = self.cfg
        T, N = frag.num_steps, frag.num_envs
        obs = self._tensor(frag.obs)
        term, trunc = self._tensor(frag.terminated), self._tensor(frag.truncated)
        current: torch.Tensor | None = None
        if isinstance(self.net, RecurrentActorCritic):
            # Replay each env's sequence from its recorded state: outputs at obs[0..T], and the state
            # after each episode's last step (an end at t starts a new piece at t + 1: `unroll`'s ends).
            out, ends = self.net.unroll(obs, self._tensor(frag.extras[STATE_EXTRA]), starts_afresh(term | trunc, T + 1))
            values = self.net.values(out).view(T + 1, N)
            next_values = values[1:].clone()
            if len(frag.final_index):   # V(final obs) from the state after the episode's last step
                at = self._tensor(frag.final_index)
                next_values.view(-1)[at] = self.net.value_after(self._tensor(frag.final_obs), ends[:T].flatten(0, 1)[at])
            if correct or c.decoupled:
                steps = out[:T].flatten(0, 1)
                current = self.net.heads(steps, mask)[0].log_prob(self._actions(frag)).view(T, N)
        else:
            values = self.net.value(obs.flatten(0, 1)).view(T + 1, N)
            next_values = values[1:].clone()
            if len(frag.final_index):
                next_values.view(-1)[self._tensor(frag.final_index)] = self.net.value(self._tensor(frag.final_obs))
            if correct or c.decoupled:
                current = self.net.dist(obs[:-1].flatten(0, 1), mask).log_prob(self._actions(frag)).view(T, N)
        rewards = self._tensor(frag.rewards) * c.reward_scale
        if self.rewards is not None:
            rewards = self.rewards.scale(rewards)
        behaviour = self._tensor(frag.extras["behaviour_logprob"])
        # (`current`: log pi(a|s) of the current policy (pi_prox), what V-trace and the decoupled objective need)
        if current is not None and correct:
            adv, ret = vtrace(rewards, values[:-1], next_values, term, term | trunc, current - behaviour, c.gamma,
                              c.gae_lambda, c.vtrace_rho_bar, c.vtrace_c_bar)
        else:
            adv, ret = gae(rewards, values[:-1], next_values, term, term | trunc, c.gamma, c.gae_lambda)
        rows = obs[:-1].flatten(0, 1), values[:-1].reshape(-1), adv.reshape(-1), ret.reshape(-1)
        if current is None or not c.decoupled:
            return *rows, behaviour.reshape(-1), None
        # (V-trace's advantages carry rho = min(rho_bar, pi/mu) already: weight 1 there)
        weights = torch.ones_like(current) if correct else (current - behaviour).exp().clamp(max=c.decoupled_rho_bar)
        return *rows, current.reshape(-1), weights.reshape(-1)

    def update(self, fragments: list[Fragment], correct: list[bool] | None = None) -> dict[str, float]:
        """One update: num_epochs x num_minibatches gradient steps on the fragments. `correct[i]`
        marks fragment i for V-trace targets instead of GAE. Returns scalar diagnostics.

        In a group of learners every gradient step averages over the group, so each learner takes
        exactly num_epochs x num_minibatches steps whatever it holds: empty minibatches (or no fragments
        at all) join the average with weight 0. The version advances where anyone in the group trained.
        A step whose loss or (averaged) gradient is not finite is not taken, on every learner alike;
        the update's other steps go on, and the version advances only if one of them was taken."""
        c = self.cfg
        if not fragments and self.sync is None:
            return {}
        self._update_obs_stats(fragments)
        self._update_reward_stats(fragments)
        correct = correct or [False] * len(fragments)
        # (obs, values, advantages, returns, actions, anchor log-probs, weights, masks), a row per sample
        data: Rows | None = None
        if fragments:
            masked = any(f.action_mask is not None for f in fragments)
            masks = [self._mask(f, masked) for f in fragments]
            parts = [self._advantages(f, fix, m) for f, fix, m in zip(fragments, correct, masks)]
            obs, values, adv, ret, anchor = (torch.cat(x) for x in list(zip(*parts))[:5])
            weights = [p[5] for p in parts]
            data = (obs, values, adv, ret, torch.cat([self._actions(f) for f in fragments]), anchor,
                    torch.cat([w for w in weights if w is not None]) if c.decoupled else None,
                    torch.cat([m for m in masks if m is not None]) if masked else None)  # (masked: none is None)
        n = sum(f.num_samples for f in fragments)
        # What a minibatch draws: rows (samples), or with a recurrent core whole sequences (env columns
        # of fragments), each replayed from its recorded state.
        seqs = Sequences(fragments, self.device) if self.recurrent else None
        units = n if seqs is None else seqs.count
        remaining = self.remaining()
        for group in self.optimizer.param_groups:
            group["lr"] = c.learning_rate * remaining
        clip = c.clip_coef * (remaining if c.anneal_clip else 1.0)
        # Exactly num_minibatches per epoch, sizes differing by at most one (alone: at most as many as
        # there are units to split).
        splits = c.num_minibatches if self.sync is not None else min(c.num_minibatches, units)
        clipfracs, last, trained = [], None, False
        for _ in range(c.num_epochs):
            for mb in torch.tensor_split(torch.randperm(units, device=self.device), splits):
                self.optimizer.zero_grad(set_to_none=True)
                loss, rows = None, 0
                if len(mb):
                    assert data is not None   # (rows to split: there were fragments)
                    loss, last, rows = self._loss(data, mb if seqs is None else seqs.replay(self.net, data, mb), clip)
                    loss.backward()
                    clipfracs.append(last["clipfrac"].item())
                params = list(self.net.parameters())
                if average_over_group(self.sync, params, float(rows), loss) == 0:
                    continue
                if not finite_gradients(params):
                    skipped_step(self.metrics, "ppo", self.version)
                    continue
                torch.nn.utils.clip_grad_norm_(self.net.parameters(), c.max_grad_norm)
                self.optimizer.step()
                self.gradient_steps += 1
                trained = True
        if trained:
            self.version += 1
        if last is None:
            return {}
        out = {**{k: v.item() for k, v in last.items()}, "clipfrac": float(np.mean(clipfracs)),
               "learning_rate": c.learning_rate * remaining}
        if self.rewards is not None:
            out["return_std"] = float(self.rewards.stats.var.sqrt())
        return out

    def remaining(self) -> float:
        """The share of the learning rate (and clip range) this update trains at: 1 without annealing,
        else 1 - version / anneal_updates, down to 0 (SB3's progress_remaining, counted in updates)."""
        n = self.cfg.anneal_updates
        return 1.0 if n is None else max(0.0, 1.0 - self.version / n)

    def _update_obs_stats(self, fragments: list[Fragment]) -> None:
        """Merge the batch's observations (each step's once) into the network's running statistics,
        summed over the group first where there is one, before anything is computed with them."""
        norm = self.net.obs_norm
        if norm is None:
            return
        if fragments:
            # (a sum of at least one tensor: a tensor, where typeshed's sum allows its start, 0)
            moments: torch.Tensor = sum(  # type: ignore[assignment]
                norm.moments(self._tensor(f.obs[:-1]).flatten(0, 1).flatten(1)) for f in fragments)
        else:  # a group member with nothing still takes part in the sum
            moments = torch.zeros(1 + 2 * norm.mean.numel(), dtype=torch.float64, device=self.device)
        norm.merge(moments if self.sync is None else self.sync.sum(moments))

    def _update_reward_stats(self, fragments: list[Fragment]) -> None:
        """Merge the batch's discounted returns into the reward statistics (ppo.normalize_rewards),
        summed over the group first, before any reward of the batch is scaled with them."""
        if self.rewards is None:
            return
        moments = torch.zeros(3, dtype=torch.float64, device=self.device)
        for f in fragments:
            moments += ObsNormalizer.moments(torch.as_tensor(self.rewards.returns(f).reshape(-1, 1), device=self.device))
        self.rewards.stats.merge(moments if self.sync is None else self.sync.sum(moments))

    def _loss(self, data: Rows, mb: torch.Tensor | Replayed, clip: float
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
        """The clipped PPO loss on minibatch `mb` at clip range `clip`, its diagnostics (detached) and
        its rows: `mb` indexes rows of `data` (feed-forward), or is the sequences a recurrent core
        replayed (`Sequences.replay`: their rows, distributions and values)."""
        c = self.cfg
        obs, values, adv, ret, actions, anchor, weights, masks = data
        if isinstance(mb, torch.Tensor):
            assert isinstance(self.net, ActorCritic)
            dist, new_value = self.net.dist_and_value(obs[mb], None if masks is None else masks[mb])
        else:
            mb, dist, new_value = mb
        logratio = dist.log_prob(actions[mb]) - anchor[mb]
        ratio = logratio.exp()
        with torch.no_grad():
            approx_kl = ((ratio - 1) - logratio).mean()
            clipfrac = ((ratio - 1.0).abs() > clip).float().mean()
        mb_adv = adv[mb]
        if c.norm_adv and len(mb) > 1:
            mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
        pg = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 1 - clip, 1 + clip))
        pg_loss = (pg if weights is None else weights[mb] * pg).mean()
        if c.clip_vloss:
            v_clipped = values[mb] + torch.clamp(new_value - values[mb], -clip, clip)
            v_loss = 0.5 * torch.max((new_value - ret[mb]) ** 2, (v_clipped - ret[mb]) ** 2).mean()
        else:
            v_loss = 0.5 * ((new_value - ret[mb]) ** 2).mean()
        entropy = dist.entropy().mean()
        loss = pg_loss - c.ent_coef * entropy + c.vf_coef * v_loss
        return loss, {"policy_loss": pg_loss.detach(), "value_loss": v_loss.detach(), "entropy": entropy.detach(),
                      "approx_kl": approx_kl, "clipfrac": clipfrac}, len(mb)



    def state_dict(self) -> dict[str, Any]:
        state = {"net": self.net.state_dict(), "optimizer": self.optimizer.state_dict(), "version": self.version,
                 "gradient_steps": self.gradient_steps}
        if self.rewards is not None:
            state["reward_stats"] = self.rewards.stats.state_dict()
        return state

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.net.load_state_dict(state["net"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.version = int(state["version"])
        self.gradient_steps = int(state.get("gradient_steps", 0))
        if self.rewards is not None and "reward_stats" in state:   # (a checkpoint from before: start afresh)
            self.rewards.stats.load_state_dict(state["reward_stats"])


Learner = PPO

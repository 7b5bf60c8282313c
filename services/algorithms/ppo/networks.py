"""PPO's network (torch): a policy head over any action space and a value head."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from services.common.models.heads import ActionDist, Head, out_features
from services.common.models.nets import (EnvSpec, NatureCNN, OneHot, flat_obs, is_image, layer, mlp,
                                         obs_normalizer)

if TYPE_CHECKING:
    from services.algorithms.ppo.config import PPOConfig


class ActorCritic(nn.Module):
    """Policy and value heads. Flat observations: separate tanh MLPs (CleanRL's ppo.py). Frames: one
    shared Nature CNN torso with a policy head (std 0.01) and a value head (std 1), as in CleanRL's
    ppo_atari.py. The policy's output layer parameterises the action space's distribution
    (services/common/models/heads.py: categorical, a product of categoricals, or a diagonal Gaussian)."""

    def __init__(self, spec: EnvSpec, hidden: tuple[int, ...], normalize_obs: bool = False, obs_clip: float = 10.0):
        super().__init__()
        n_out = out_features(spec.action)
        if normalize_obs and is_image(spec):
            raise ValueError("ppo.normalize_observations: frames are scaled by 1/255 in the network; "
                             "normalisation is for flat observations")
        # Observation statistics (a module only when used: checkpoints without it stay loadable), of the
        # elements that are not categorical; those are one-hot encoded (`OneHot`) after it.
        self.obs_norm = obs_normalizer(spec, obs_clip) if normalize_obs else None
        self.one_hot = OneHot(spec)
        self.torso: nn.Module
        self.critic: nn.Module
        self.actor: nn.Module
        if is_image(spec):
            cnn = NatureCNN(spec)
            self.torso = cnn
            self.critic = layer(cnn.features, 1, std=1.0)
            self.actor = layer(cnn.features, n_out, std=0.01)
        else:
            n_in = self.one_hot.width
            self.torso = nn.Flatten(1)
            self.critic = mlp(n_in, hidden, 1, nn.Tanh, out_std=1.0)
            self.actor = mlp(n_in, hidden, n_out, nn.Tanh, out_std=0.01)
        self.head = Head(spec.action)
        self._flat = not is_image(spec)

    def _features(self, obs: torch.Tensor) -> torch.Tensor:
        if not self._flat:
            features: torch.Tensor = self.torso(obs)
            return features
        x = flat_obs(obs)
        encoded: torch.Tensor = self.one_hot(x if self.obs_norm is None else self.obs_norm(x))
        return encoded

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        v: torch.Tensor = self.critic(self._features(obs))
        return v.squeeze(-1)

    def dist(self, obs: torch.Tensor, mask: torch.Tensor | None = None) -> ActionDist:
        """The action distribution at `obs` ([B, ...]); `mask` [B, M] bool: the allowed actions."""
        dist: ActionDist = self.head(self.actor(self._features(obs)), mask)
        return dist

    def mode(self, obs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The most likely action at `obs` (heads.Head.mode): argmax of the logits, or the Gaussian's mean."""
        return self.head.mode(self.actor(self._features(obs)), mask)

    def dist_and_value(self, obs: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[ActionDist, torch.Tensor]:
        """Both heads from one pass through the torso (what the PPO update needs per minibatch)."""
        x = self._features(obs)
        v: torch.Tensor = self.critic(x)
        return self.head(self.actor(x), mask), v.squeeze(-1)


class RecurrentActorCritic(nn.Module):
    """ppo.recurrent: a torso (a tanh MLP of `hidden` widths over flat observations, or the Nature CNN
    over frames), then an LSTM or GRU of `size` units (one layer), then a policy head (std 0.01) and
    a value head (std 1) on its output, shared as in CleanRL's ppo_atari_lstm.py.

    The recurrent state of a batch of envs is one float32 tensor [B, state_size]: h, then c for an
    LSTM. Actors take one step at a time (`step`: the cell's equations written out, which every
    exporter traces); the learner replays whole sequences (`unroll`): each env column is cut where
    `resets` marks an episode's first step, and the pieces run through torch's fused nn.LSTM / nn.GRU
    as one packed batch, the first piece of a column from its recorded state and every later one
    from zeros. Both compute the same function (tests/unit/learner/test_recurrent.py)."""

    def __init__(self, spec: EnvSpec, hidden: tuple[int, ...], core: str, size: int, normalize_obs: bool = False,
                 obs_clip: float = 10.0, separate_critic: bool = False):
        super().__init__()
        if normalize_obs and is_image(spec):
            raise ValueError("ppo.normalize_observations: frames are scaled by 1/255 in the network; "
                             "normalisation is for flat observations")
        self.obs_norm = obs_normalizer(spec, obs_clip) if normalize_obs else None
        self.one_hot = OneHot(spec)
        self._flat = not is_image(spec)
        self.torso: nn.Module
        if self._flat:
            layers: list[nn.Module] = [nn.Flatten(1)]
            features = self.one_hot.width
            for width in hidden:
                layers += [layer(features, width), nn.Tanh()]
                features = width
            self.torso = nn.Sequential(*layers)
        else:
            cnn = NatureCNN(spec)
            self.torso, features = cnn, cnn.features
        self.lstm = core == "lstm"
        self.size = size
        self.core: nn.LSTM | nn.GRU = self._new_core(features)
        # ppo.critic_core "separate": the value head reads a core of its own (sb3-contrib's
        # enable_critic_lstm), so the value loss does not shape the policy's memory.
        self.critic_core: nn.LSTM | nn.GRU | None = self._new_core(features) if separate_critic else None
        self.cores = [self.core] if self.critic_core is None else [self.core, self.critic_core]
        self.core_state = 2 * size if self.lstm else size          # floats of one core's state
        self.state_size = self.core_state * len(self.cores)        # the actor core's state, then the critic's
        self.actor = layer(size, out_features(spec.action), std=0.01)
        self.critic = layer(size, 1, std=1.0)
        self.head = Head(spec.action)

    def _new_core(self, features: int) -> nn.LSTM | nn.GRU:
        core = (nn.LSTM if self.lstm else nn.GRU)(features, self.size)
        for name, param in core.named_parameters():   # (CleanRL's ppo_atari_lstm.py initialisation)
            if "bias" in name:
                nn.init.constant_(param, 0.0)
            else:
                nn.init.orthogonal_(param, 1.0)
        return core

    def initial_state(self, n: int) -> torch.Tensor:
        """The state of `n` envs at the start of an episode: zeros [n, state_size]."""
        return torch.zeros(n, self.state_size)

    def _encode(self, obs: torch.Tensor) -> torch.Tensor:
        if not self._flat:
            features: torch.Tensor = self.torso(obs)
            return features
        x = flat_obs(obs)
        out: torch.Tensor = self.torso(self.one_hot(x if self.obs_norm is None else self.obs_norm(x)))
        return out

    @staticmethod
    def _weights(core: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """A core's one layer: (weight_ih, weight_hh, bias_ih, bias_hh), as nn.LSTM / nn.GRU keep them."""
        w = [getattr(core, f"{name}_l0") for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")]
        assert all(isinstance(t, torch.Tensor) for t in w)
        return w[0], w[1], w[2], w[3]

    def _cell(self, core: nn.Module, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of `core` (nn.LSTM's or nn.GRU's equations, on its weights) on features `x` [B, F]
        from its `state` [B, core_state]: (output [B, size], the state after)."""
        w_ih, w_hh, b_ih, b_hh = self._weights(core)
        gates_x = F.linear(x, w_ih, b_ih)
        h = state[:, :self.size]
        gates_h = F.linear(h, w_hh, b_hh)
        if self.lstm:
            i, f, g, o = (gates_x + gates_h).chunk(4, 1)
            cell = torch.sigmoid(f) * state[:, self.size:] + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(cell)
            return h, torch.cat([h, cell], dim=1)
        x_r, x_z, x_n = gates_x.chunk(3, 1)
        h_r, h_z, h_n = gates_h.chunk(3, 1)
        z = torch.sigmoid(x_z + h_z)
        h = (1 - z) * torch.tanh(x_n + torch.sigmoid(x_r + h_r) * h_n) + z * h
        return h, h

    def core_step(self, x: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step of the core(s) on features `x` [B, F] from `state` [B, state_size]: (output [B,
        size], or [B, 2 x size] with a separate critic core (the policy's part, then the critic's),
        the state after)."""
        outs, states = [], []
        for k, core in enumerate(self.cores):
            out, after = self._cell(core, x, state[:, k * self.core_state:(k + 1) * self.core_state])
            outs.append(out)
            states.append(after)
        return torch.cat(outs, dim=1), torch.cat(states, dim=1)

    def step(self, obs: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The core's output at one observation per env [B, ...] from `state`, and the state after."""
        return self.core_step(self._encode(obs), state)

    def unroll(self, obs: torch.Tensor, state: torch.Tensor, resets: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay sequences: `obs` [T, B, ...] from `state` [B, state_size]; `resets` [T, B] bool marks
        the steps whose state is zeroed first (an episode starts there). Returns the core's outputs
        [T, B, ...] (as `core_step`'s) and `ends` [T, B, state_size]: the state after step t wherever
        step t ends a piece (t + 1 resets, or t = T - 1), zeros elsewhere (what a final observation's
        value reads)."""
        T, B = resets.shape
        x = self._encode(obs.flatten(0, 1)).view(T, B, -1)
        # Pieces in column-major order: column b's steps t0..t1 between resets.
        starts = resets.t().clone()
        starts[:, 0] = True
        flat_starts = starts.reshape(-1)
        piece = torch.cumsum(flat_starts.long(), 0) - 1                    # [B*T] the piece of each step
        first = torch.nonzero(flat_starts).squeeze(1)                       # [P] its first flat position
        lengths = torch.diff(first, append=torch.tensor([B * T], device=first.device))
        where = torch.arange(B * T, device=first.device) - first[piece]     # position inside the piece
        col = first // T
        keep = ((first % T == 0) & ~resets[0, col]).unsqueeze(-1).to(state.dtype)
        init = state[col] * keep                                            # [P, S]: recorded, or zeros
        padded = x.new_zeros(int(lengths.max()), len(first), x.shape[-1])
        padded[where, piece] = x.transpose(0, 1).reshape(B * T, -1)
        packed = nn.utils.rnn.pack_padded_sequence(padded, lengths.cpu(), enforce_sorted=False)
        outs, lasts = [], []
        for k, core in enumerate(self.cores):
            part = init[:, k * self.core_state:(k + 1) * self.core_state]
            h0 = part[:, :self.size].unsqueeze(0).contiguous()
            if self.lstm:
                out_p, (h_n, c_n) = core(packed, (h0, part[:, self.size:].unsqueeze(0).contiguous()))
                lasts.append(torch.cat([h_n[0], c_n[0]], dim=1))
            else:
                out_p, h_n = core(packed, h0)
                lasts.append(h_n[0])
            out, _ = nn.utils.rnn.pad_packed_sequence(out_p)                # [L, P, size]
            outs.append(out[where, piece])
        outputs = torch.cat(outs, dim=1).view(B, T, -1).transpose(0, 1)
        ends = x.new_zeros(B * T, self.state_size)
        ends[first + lengths - 1] = torch.cat(lasts, dim=1)
        return outputs, ends.view(B, T, -1).transpose(0, 1)

    def heads(self, out: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[ActionDist, torch.Tensor]:
        """The action distribution and the value at core outputs `out` [B, ...] (`core_step`'s)."""
        v: torch.Tensor = self.critic(out[:, -self.size:])
        return self.head(self.actor(out[:, :self.size]), mask), v.squeeze(-1)

    def values(self, out: torch.Tensor) -> torch.Tensor:
        """The values at core outputs `out` [..., ...] (`core_step`'s or `unroll`'s)."""
        v: torch.Tensor = self.critic(out[..., -self.size:])
        return v.squeeze(-1)

    def value_after(self, obs: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """V of observations [B, ...] seen from `state` (the value of a final observation, from the
        state after its episode's last step)."""
        out, _ = self.step(obs, state)
        return self.values(out)

    def mode(self, obs: torch.Tensor, state: torch.Tensor, mask: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The most likely actions at `obs` [B, ...] from `state`, and the state after."""
        out, state = self.step(obs, state)
        return self.head.mode(self.actor(out[:, :self.size]), mask), state


def make_net(spec: EnvSpec, cfg: PPOConfig) -> ActorCritic | RecurrentActorCritic:
    """The network `cfg` asks for: feed-forward, or with a recurrent core (ppo.recurrent)."""
    if cfg.recurrent is None:
        return ActorCritic(spec, cfg.hidden_sizes, cfg.normalize_observations, cfg.obs_clip)
    return RecurrentActorCritic(spec, cfg.hidden_sizes, cfg.recurrent, cfg.recurrent_size,
                                cfg.normalize_observations, cfg.obs_clip, cfg.critic_core == "separate")

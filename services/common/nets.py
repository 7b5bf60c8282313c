"""Policy networks shared by the actor (inference) and the learner (training), as in CleanRL.

Imports torch and gymnasium: only the actor and the learner may import this module (an
import-linter contract keeps the buffer and planner away from it).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from services.common import envs
from services.common.config import EnvConfig
from services.common.heads import Head, out_features
from services.common.spaces import ActionSpace, Box
from services.common.envs import EnvSpec, spec_of  # noqa: F401  (re-exported: the networks' view of an env)


def env_spec(env_id: str, max_episode_steps: int | None = None) -> EnvSpec:
    """The spaces of env `env_id` with default preprocessing (see envs.env_spec)."""
    return envs.env_spec(EnvConfig(id=env_id, max_episode_steps=max_episode_steps))


def resolve_device(device: str) -> torch.device:
    """`learner.device` as a torch device: "auto" is cuda when torch sees a GPU, else cpu.

    Raises ValueError naming learner.device when cuda is asked for and none is available.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"learner.device: {device!r} but torch sees no CUDA device "
                             f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}); use cpu or auto")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"learner.device: {device!r} but only {torch.cuda.device_count()} CUDA devices exist")
    return dev


def _layer(inp: int, out: int, std: float = np.sqrt(2), bias: float = 0.0) -> nn.Linear:
    layer = nn.Linear(inp, out)
    nn.init.orthogonal_(layer.weight, std)
    nn.init.constant_(layer.bias, bias)
    return layer


def mlp(inp: int, hidden: tuple[int, ...], out: int, act: type[nn.Module], out_std: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [_layer(inp, h), act()]
        inp = h
    layers.append(_layer(inp, out, std=out_std))
    return nn.Sequential(*layers)


def is_image(spec: EnvSpec) -> bool:
    """Observations the Nature CNN takes: [C, H, W] uint8 frames (Atari)."""
    return len(spec.obs_shape) == 3 and spec.obs_dtype == np.uint8


class NatureCNN(nn.Module):
    """The Nature DQN torso (Mnih et al. 2015): 3 conv layers and a 512-unit layer, over uint8 frames.

    Frames arrive as uint8 (they travel that way from the env) and are scaled to [0, 1] here, on the
    device the network lives on, as in CleanRL's dqn_atari.py / ppo_atari.py.
    """

    def __init__(self, spec: EnvSpec, features: int = 512):
        super().__init__()
        c, h, w = spec.obs_shape
        self.convs = nn.Sequential(
            _conv(c, 32, 8, 4), nn.ReLU(), _conv(32, 64, 4, 2), nn.ReLU(), _conv(64, 64, 3, 1), nn.ReLU(),
            nn.Flatten())
        with torch.no_grad():
            n_flat = self.convs(torch.zeros(1, c, h, w)).shape[1]
        self.fc = nn.Sequential(_layer(n_flat, features), nn.ReLU())
        self.features = features

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.fc(self.convs(obs.float() / 255.0))


def _conv(inp: int, out: int, kernel: int, stride: int) -> nn.Conv2d:
    conv = nn.Conv2d(inp, out, kernel, stride)
    nn.init.orthogonal_(conv.weight, np.sqrt(2))
    nn.init.constant_(conv.bias, 0.0)
    return conv


class QNetwork(nn.Module):
    """Q(s, .) for discrete actions: an MLP over flat observations, or the Nature CNN over frames
    (then `hidden` is unused: the CNN's 512-unit layer is the hidden layer)."""

    def __init__(self, spec: EnvSpec, hidden: tuple[int, ...]):
        super().__init__()
        if is_image(spec):
            torso = NatureCNN(spec)
            self.q = nn.Sequential(torso, _layer(torso.features, spec.num_actions, std=1.0))
            self._flat = False
        else:
            self.q = mlp(int(np.prod(spec.obs_shape)), hidden, spec.num_actions, nn.ReLU, out_std=1.0)
            self._flat = True

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.q(obs.flatten(1).float() if self._flat else obs)

    def mode(self, obs: torch.Tensor) -> torch.Tensor:
        """The greedy action: argmax_a Q(s, a)."""
        return self(obs).argmax(dim=1)


class ObsNormalizer(nn.Module):
    """Running mean and variance of flat observations, clipped after normalising (gymnasium's
    NormalizeObservation, SB3's VecNormalize). The statistics are float64 buffers of the module, so
    they travel with the weights to actors and into checkpoints. `update` merges a batch in by the
    parallel algorithm of Chan et al. (1979); `moments` and `merge` split it for a learner group,
    which sums every rank's batch moments before merging them, so all ranks keep the same statistics.
    """

    def __init__(self, size: int, clip: float = 10.0, eps: float = 1e-8):
        super().__init__()
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(size, dtype=torch.float64))
        self.register_buffer("var", torch.ones(size, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = (self.var + self.eps).sqrt()
        return ((x - self.mean.to(x.dtype)) / std.to(x.dtype)).clamp(-self.clip, self.clip)

    @staticmethod
    def moments(x: torch.Tensor) -> torch.Tensor:
        """[count, sum, sum of squares] of a batch [B, size] in float64: what a group sums."""
        x = x.to(torch.float64)
        return torch.cat([torch.tensor([float(len(x))], dtype=torch.float64, device=x.device),
                          x.sum(0), (x * x).sum(0)])

    @torch.no_grad()
    def merge(self, moments: torch.Tensor) -> None:
        """Merge a batch given by its `moments` (summed over any number of batches) into the statistics."""
        size = self.mean.numel()
        n, total, squares = moments[0], moments[1:1 + size], moments[1 + size:]
        if n <= 0:
            return
        b_mean = total / n
        b_var = (squares / n - b_mean * b_mean).clamp(min=0.0)
        m = self.count
        delta = b_mean - self.mean
        new = m + n
        self.mean += delta * n / new
        self.var.copy_((self.var * m + b_var * n + delta * delta * m * n / new) / new)
        self.count.copy_(new)

    def update(self, x: torch.Tensor) -> None:
        self.merge(self.moments(x.flatten(1)))


class ActorCritic(nn.Module):
    """Policy and value heads. Flat observations: separate tanh MLPs (CleanRL's ppo.py). Frames: one
    shared Nature CNN torso with a policy head (std 0.01) and a value head (std 1), as in CleanRL's
    ppo_atari.py. The policy's output layer parameterises the action space's distribution
    (services/common/heads.py: categorical, a product of categoricals, or a diagonal Gaussian)."""

    def __init__(self, spec: EnvSpec, hidden: tuple[int, ...], normalize_obs: bool = False, obs_clip: float = 10.0):
        super().__init__()
        n_out = out_features(spec.action)
        if normalize_obs and is_image(spec):
            raise ValueError("ppo.normalize_observations: frames are scaled by 1/255 in the network; "
                             "normalisation is for flat observations")
        # Observation statistics (a module only when used: checkpoints without it stay loadable).
        self.obs_norm = ObsNormalizer(int(np.prod(spec.obs_shape)), obs_clip) if normalize_obs else None
        if is_image(spec):
            self.torso = NatureCNN(spec)
            self.critic = _layer(self.torso.features, 1, std=1.0)
            self.actor = _layer(self.torso.features, n_out, std=0.01)
        else:
            n_in = int(np.prod(spec.obs_shape))
            self.torso = nn.Flatten(1)
            self.critic = mlp(n_in, hidden, 1, nn.Tanh, out_std=1.0)
            self.actor = mlp(n_in, hidden, n_out, nn.Tanh, out_std=0.01)
        self.head = Head(spec.action)
        self._flat = not is_image(spec)

    def _features(self, obs: torch.Tensor) -> torch.Tensor:
        if not self._flat:
            return self.torso(obs)
        x = obs.flatten(1).float()
        return x if self.obs_norm is None else self.obs_norm(x)

    def value(self, obs: torch.Tensor) -> torch.Tensor:
        return self.critic(self._features(obs)).squeeze(-1)

    def dist(self, obs: torch.Tensor, mask: torch.Tensor | None = None):
        """The action distribution at `obs` ([B, ...]); `mask` [B, M] bool: the allowed actions."""
        return self.head(self.actor(self._features(obs)), mask)

    def mode(self, obs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """The most likely action at `obs` (heads.Head.mode): argmax of the logits, or the Gaussian's mean."""
        return self.head.mode(self.actor(self._features(obs)), mask)

    def dist_and_value(self, obs: torch.Tensor, mask: torch.Tensor | None = None):
        """Both heads from one pass through the torso (what the PPO update needs per minibatch)."""
        x = self._features(obs)
        return self.head(self.actor(x), mask), self.critic(x).squeeze(-1)


class GreedyPolicy(nn.Module):
    """A policy network's deterministic actions as a module of its own: `net.mode(obs)` (argmax of Q or
    of the logits, the Gaussian's mean, SAC's squashed mean), Box actions clipped into the space's
    bounds as actors clip what they send to the env. What `kuberl eval` runs by default and `kuberl
    export` writes: its forward holds no distribution objects and no Python branching on data, so it
    traces into one graph, observation normalisation (a submodule of `net`) included."""

    def __init__(self, net: nn.Module, space: ActionSpace):
        super().__init__()
        self.net = net
        self.bounded = isinstance(space, Box)
        if self.bounded:
            self.register_buffer("low", torch.as_tensor(space.low_array, dtype=torch.float32))
            self.register_buffer("high", torch.as_tensor(space.high_array, dtype=torch.float32))

    def forward(self, obs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        action = self.net.mode(obs) if mask is None else self.net.mode(obs, mask)
        if self.bounded:  # (minimum/maximum rather than clamp with tensor bounds: every ONNX opset has them)
            action = torch.maximum(torch.minimum(action, self.high), self.low)
        return action


def to_numpy(module: nn.Module) -> dict[str, np.ndarray]:
    """The module's parameters and buffers as CPU numpy arrays (copies)."""
    return {k: v.detach().cpu().numpy().copy() for k, v in module.state_dict().items()}


def load_numpy(module: nn.Module, arrays: dict[str, np.ndarray]) -> None:
    """Load arrays produced by `to_numpy` (possibly read-only views) into `module`; strict names and shapes."""
    state = {k: torch.from_numpy(np.array(v)) for k, v in arrays.items()}
    module.load_state_dict(state, strict=True)

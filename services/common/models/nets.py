"""The building blocks of every algorithm's networks (torch), as in CleanRL: initialised layers, MLPs,
the Nature CNN torso, observation normalisation, the greedy policy module, weights as numpy arrays.
Each algorithm's own networks are in its package (services/algorithms/<name>/networks.py).

Imports torch and gymnasium: only the actor and the learner may import this module (an
import-linter contract keeps the buffer and planner away from it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from services.common import envs
from services.common.config import EnvConfig
from services.common.protocol.spaces import ActionSpace, Box
from services.common.envs import EnvSpec as EnvSpec  # re-exported: the networks' view of an env
from services.common.envs import spec_of as spec_of
from services.common.envs import policy_spec as policy_spec


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


def layer(inp: int, out: int, std: float = np.sqrt(2), bias: float = 0.0) -> nn.Linear:
    """A linear layer with orthogonal weights of gain `std` and a constant bias (CleanRL's layer_init)."""
    lin = nn.Linear(inp, out)
    nn.init.orthogonal_(lin.weight, std)
    nn.init.constant_(lin.bias, bias)
    return lin


def mlp(inp: int, hidden: tuple[int, ...], out: int, act: type[nn.Module], out_std: float) -> nn.Sequential:
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [layer(inp, h), act()]
        inp = h
    layers.append(layer(inp, out, std=out_std))
    return nn.Sequential(*layers)


def flat_obs(obs: torch.Tensor) -> torch.Tensor:
    """Observations [B, *obs_shape] as float rows [B, flat size] (a Discrete observation's [B] as [B, 1])."""
    return (obs.flatten(1) if obs.dim() > 1 else obs.unsqueeze(1)).float()


class OneHot(nn.Module):
    """The first step over flat observations: their categorical elements (`spec.obs_categories`: a
    Discrete or MultiDiscrete observation, or such keys of a Dict) one-hot encoded, as SB3's
    preprocess_obs does, after the other elements in their order. `forward`: float rows [B, flat size]
    (`flat_obs`, after any normalisation, which skips the categorical elements) -> [B, width].

    Element i with value v sets column j where src[j] = i and values[j] = v: a gather and a comparison,
    which every exporter traces into plain ops (Gather, Equal, Cast), and an index outside 0..n-1 gives
    n zeros rather than an error. Actors and sessions refuse such observations before they get here
    (spaces.check_observations). No parameters, and its index buffers are not persistent: it adds
    nothing to a checkpoint, and the identity for a Box observation."""
    keep: torch.Tensor    # buffers (register_buffer, not persistent)
    src: torch.Tensor
    values: torch.Tensor

    def __init__(self, spec: EnvSpec):
        super().__init__()
        size = int(np.prod(spec.obs_shape))
        cats = spec.obs_categories
        categorical = {i for i, _ in cats}
        keep = [i for i in range(size) if i not in categorical]
        self.identity = not cats
        self.any_kept = bool(keep)
        self.width = len(keep) + sum(n for _, n in cats)
        self.register_buffer("keep", torch.tensor(keep, dtype=torch.long), persistent=False)
        self.register_buffer("src", torch.tensor([i for i, n in cats for _ in range(n)], dtype=torch.long),
                             persistent=False)
        self.register_buffer("values", torch.cat([torch.arange(n, dtype=torch.float32) for _, n in cats])
                             if cats else torch.zeros(0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.identity:
            return x
        onehot = (x.index_select(1, self.src) == self.values.to(x.dtype)).to(x.dtype)
        return torch.cat([x.index_select(1, self.keep), onehot], 1) if self.any_kept else onehot


def obs_features(spec: EnvSpec) -> int:
    """The width of flat observations after one-hot encoding (`OneHot`): a flat MLP's input size."""
    return OneHot(spec).width


def obs_normalizer(spec: EnvSpec, clip: float) -> ObsNormalizer | None:
    """The running normaliser of `spec`'s flat observations, which leaves categorical elements as they
    are (they are one-hot encoded after it); None where every element is categorical."""
    size = int(np.prod(spec.obs_shape))
    if len(spec.obs_categories) == size:
        return None
    return ObsNormalizer(size, clip, skip=tuple(i for i, _ in spec.obs_categories))


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
        self.fc = nn.Sequential(layer(n_flat, features), nn.ReLU())
        self.features = features

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        features: torch.Tensor = self.fc(self.convs(obs.float() / 255.0))
        return features


def _conv(inp: int, out: int, kernel: int, stride: int) -> nn.Conv2d:
    conv = nn.Conv2d(inp, out, kernel, stride)
    nn.init.orthogonal_(conv.weight, np.sqrt(2))
    assert conv.bias is not None   # (made with a bias, the default)
    nn.init.constant_(conv.bias, 0.0)
    return conv


class ObsNormalizer(nn.Module):
    """Running mean and variance of flat observations, clipped after normalising (gymnasium's
    NormalizeObservation, SB3's VecNormalize). The statistics are float64 buffers of the module, so
    they travel with the weights to actors and into checkpoints. `update` merges a batch in by the
    parallel algorithm of Chan et al. (1979); `moments` and `merge` split it for a learner group,
    which sums every rank's batch moments before merging them, so all ranks keep the same statistics.
    """
    mean: torch.Tensor    # buffers (register_buffer)
    var: torch.Tensor
    count: torch.Tensor
    scaled: torch.Tensor  # (not persistent) which elements are normalised: all but `skip`

    def __init__(self, size: int, clip: float = 10.0, eps: float = 1e-8, skip: tuple[int, ...] = ()):
        """`skip`: elements passed through as they are (the categorical ones of a Dict observation,
        one-hot encoded after this); their statistics are kept but unused."""
        super().__init__()
        self.clip, self.eps = clip, eps
        self.register_buffer("mean", torch.zeros(size, dtype=torch.float64))
        self.register_buffer("var", torch.ones(size, dtype=torch.float64))
        self.register_buffer("count", torch.zeros((), dtype=torch.float64))
        self.skips = bool(skip)
        scaled = torch.ones(size, dtype=torch.bool)
        scaled[list(skip)] = False
        self.register_buffer("scaled", scaled, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        std = (self.var + self.eps).sqrt()
        y = ((x - self.mean.to(x.dtype)) / std.to(x.dtype)).clamp(-self.clip, self.clip)
        return torch.where(self.scaled, y, x) if self.skips else y

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


class ModalNet(Protocol):
    """A policy network as GreedyPolicy sees it (an nn.Module): `mode(obs)`, or `mode(obs, mask)` where
    it takes masks, gives its deterministic actions (a recurrent one's `mode(obs, state[, mask])`
    gives them with the state after: PPO's GreedyRecurrent)."""

    @property
    def mode(self) -> Callable[..., Any]: ...


class GreedyPolicy(nn.Module):
    """A policy network's deterministic actions as a module of its own: `net.mode(obs)` (argmax of Q or
    of the logits, the Gaussian's mean, SAC's squashed mean), Box actions clipped into the space's
    bounds as actors clip what they send to the env. What `kuberl eval` runs by default and `kuberl
    export` writes: its forward holds no distribution objects and no Python branching on data, so it
    traces into one graph, observation normalisation (a submodule of `net`) included."""
    net: ModalNet
    low: torch.Tensor     # buffers, where the space is a Box
    high: torch.Tensor

    def __init__(self, net: ModalNet, space: ActionSpace):
        super().__init__()
        self.net = net
        self.bounded = isinstance(space, Box)
        if isinstance(space, Box):
            self.register_buffer("low", torch.as_tensor(space.low_array, dtype=torch.float32))
            self.register_buffer("high", torch.as_tensor(space.high_array, dtype=torch.float32))

    def forward(self, obs: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        action: torch.Tensor = self.net.mode(obs) if mask is None else self.net.mode(obs, mask)
        return self.bound(action)

    def bound(self, action: torch.Tensor) -> torch.Tensor:
        """Box actions clipped into the space's bounds (others as they are)."""
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

"""SAC (Haarnoja et al. 2018): transitions in a uniform replay, served at a replay ratio the buffer
paces as DQN's are; actors sample a tanh-squashed Gaussian policy (acting.py, learner.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from kuberl.v1 import common_pb2 as pb
from services.algorithms.base import Algorithm, ReplayTable
from services.algorithms.sac.config import SACConfig
from services.common.protocol.spaces import Box

if TYPE_CHECKING:
    from services.common.config import CommonConfig
    from services.common.protocol.spaces import EnvSpec


class SAC(Algorithm[SACConfig]):
    name = "sac"
    settings = SACConfig
    code = pb.ALGORITHM_SAC
    action_spaces = (Box,)
    per_policy = ("policy_lr", "q_lr", "batch_size", "gamma", "tau", "alpha", "autotune", "target_entropy")

    def takes(self) -> str:
        # The squashed policy maps tanh's (-1, 1) onto [low, high] with float32 arithmetic.
        return "Box actions with bounds finite in float32 with low < high"

    def check_spec(self, spec: EnvSpec, action: str = "this env's action space", obs: str = "this env's observations") -> None:
        """A Box with finite bounds (the squashed policy maps onto them) over flat observations."""
        super().check_spec(spec, action, obs)
        box = spec.action
        assert isinstance(box, Box)   # (super().check_spec refused any other space)
        # The policy maps tanh's (-1, 1) onto [low, high] with float32 arithmetic: the width must fit it.
        width = np.asarray(box.high, np.float64) - np.asarray(box.low, np.float64)
        if not ((width > 0) & (width <= np.finfo(np.float32).max)).all():
            raise ValueError(f"algorithm: sac takes {self.takes()}; {action} is {box}")
        if spec.obs_dtype.kind == "u" and len(spec.obs_shape) == 3:
            raise ValueError(f"algorithm: sac takes flat observations; {obs} are "
                             f"{spec.obs_dtype.name} frames {list(spec.obs_shape)}")

    def table(self, cfg: CommonConfig) -> ReplayTable:
        s = self.section(cfg)
        return ReplayTable(s.buffer_size, s.learning_starts, s.replay_ratio, s.replay_ratio_tolerance)

    def batch_size(self, cfg: CommonConfig) -> int:
        return self.section(cfg).batch_size

    def consumption_ratio(self, cfg: CommonConfig) -> float:
        return self.section(cfg).replay_ratio

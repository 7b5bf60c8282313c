"""Checks a learner makes on a decoded batch before training on it, and the batch handling every
replay algorithm shares (numpy only).

A batch holding NaN or infinity where the learner computes with it (`check_finite`) is refused whole
with `NonFiniteError`: the trainer skips and counts it (learner/batches_nonfinite_total), so it never
reaches the weights. Actors refuse such data already (services/actor/finite.py); this is the
learner's own guard against whatever else may send it.
"""

from __future__ import annotations

import logging

import numpy as np

from kuberl.v1 import common_pb2 as pb
from services.common.envs import EnvSpec
from services.common.protocol.fragments import TRANSITION_FIELDS
from services.common.protocol.spaces import check_actions, check_mask, check_observations
from services.common.stats import Histogram, Metrics
from services.common.protocol.tensors import TensorError, check_finite, decode

log = logging.getLogger(__name__)
STEPS_SKIPPED = "learner/gradient_steps_skipped_nonfinite_total"


def skipped_step(metrics: Metrics, what: str, version: int) -> None:
    """Count an optimiser step not taken because a loss or the (group's averaged) gradient was not
    finite (services/algorithms/group.py: `finite_gradients`); log the first and every 1000th."""
    metrics.inc(STEPS_SKIPPED)
    n = int(metrics.counters[STEPS_SKIPPED])
    if n == 1 or n % 1000 == 0:
        log.warning("skipped the %s step at version %d: its loss or gradient is not finite (%d steps skipped "
                    "so far, learner/gradient_steps_skipped_nonfinite_total)", what, version, n)


def check_fits(spec: EnvSpec, *observations: np.ndarray, actions: np.ndarray, lead: tuple[int, ...],
               mask: np.ndarray | None = None, rows: int | None = None) -> None:
    """Raise TensorError unless the data fits the env: each of `observations` is [rows, *obs_shape]
    (`rows` None: any number) with its categorical elements (a Discrete observation) in range,
    `actions` is `lead` + the action space's layout with valid values, and `mask`, if any, is `lead` +
    [mask width] allowing something everywhere."""
    for obs in observations:
        if obs.shape[1:] != spec.obs_shape:
            raise TensorError("obs", f"per-step shape {list(obs.shape[1:])} does not match the env's "
                                     f"{list(spec.obs_shape)}")
        if rows is not None and len(obs) != rows:
            raise TensorError("obs", f"{len(obs)} rows, expected {rows}")
        check_observations(spec, obs, "obs")   # (one-hot would make an out-of-range value zeros, silently)
    check_actions(spec.action, actions, lead)
    if mask is not None:
        check_mask(spec.action, mask, lead)


class TransitionLearner:
    """What a replay algorithm's learner shares: batches are TransitionBatch rows, one gradient step
    per update (the version counts them). A subclass sets `spec`, `lag` (the policy-lag histogram)
    and `version`, and defines `update(rows | None)`: None joins a group's update with nothing."""
    spec: EnvSpec
    lag: Histogram
    version: int

    def update(self, rows: dict[str, np.ndarray] | None) -> dict[str, float]:
        """One gradient step on `rows` (None: the group's step with nothing of this learner's)."""
        raise NotImplementedError

    @property
    def gradient_steps(self) -> int:
        return self.version

    def decode(self, batch: pb.TrainingBatch) -> dict[str, np.ndarray]:
        """The batch's transitions as arrays; raises ValueError (TensorError) naming what does not fit."""
        data = {f: decode(getattr(batch.transitions, f), f"transitions.{f}") for f in TRANSITION_FIELDS}
        if batch.transitions.HasField("discount"):   # n-step returns (services/buffer/replay.py)
            data["discount"] = decode(batch.transitions.discount, "transitions.discount")
            if data["discount"].dtype != np.float32:
                raise TensorError("transitions.discount", f"must be float32, got {data['discount'].dtype.name}")
        rows = len(data["policy_version"])
        check_fits(self.spec, data["obs"], data["next_obs"], actions=data["actions"], lead=(rows,), rows=rows)
        for name in ("rewards", "terminated", "discount"):
            if name in data and data[name].shape != (rows,):
                raise TensorError(f"transitions.{name}", f"shape {list(data[name].shape)}, expected [{rows}]")
        check_finite({f"transitions.{f}": data.get(f) for f in ("obs", "actions", "rewards", "next_obs", "discount")})
        return data

    def learn(self, data: dict[str, np.ndarray]) -> tuple[int, dict[str, float]]:
        """One update on a decoded batch: (samples trained on, diagnostics)."""
        versions = data["policy_version"]
        self.lag.observe(self.version - versions)
        return len(versions), self.update({k: v for k, v in data.items() if k != "policy_version"})

    def empty_update(self) -> None:
        """Take part in a group's update with nothing (weight 0)."""
        self.update(None)

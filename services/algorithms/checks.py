"""Checks a learner makes on a decoded batch before training on it (numpy only)."""

from __future__ import annotations

import numpy as np

from services.common.envs import EnvSpec
from services.common.spaces import check_actions, check_mask
from services.common.tensors import TensorError


def check_fits(spec: EnvSpec, *observations: np.ndarray, actions: np.ndarray, lead: tuple[int, ...],
               mask: np.ndarray | None = None, rows: int | None = None) -> None:
    """Raise TensorError unless the data fits the env: each of `observations` is [rows, *obs_shape]
    (`rows` None: any number), `actions` is `lead` + the action space's layout with valid values,
    and `mask`, if any, is `lead` + [mask width] allowing something everywhere."""
    for obs in observations:
        if obs.shape[1:] != spec.obs_shape:
            raise TensorError("obs", f"per-step shape {list(obs.shape[1:])} does not match the env's "
                                     f"{list(spec.obs_shape)}")
        if rows is not None and len(obs) != rows:
            raise TensorError("obs", f"{len(obs)} rows, expected {rows}")
    check_actions(spec.action, actions, lead)
    if mask is not None:
        check_mask(spec.action, mask, lead)

"""Hand-made trajectory fragments for protocol tests."""

from __future__ import annotations

import numpy as np

from kuberl.v1 import common_pb2 as pb
from services.common.protocol.fragments import build_fragment


def make_fragment(actor_id: str = "actor-t", seq: int = 0, *, T: int = 4, N: int = 2,
                  algorithm: int = pb.ALGORITHM_PPO, version: int = 0, obs_dim: int = 4,
                  done_at: tuple[int, int] | None = (1, 0), fill: float = 0.0) -> pb.TrajectoryFragment:
    """A valid fragment of T steps x N envs; `done_at` = (t, n) of one terminated step, or None."""
    obs = (np.arange((T + 1) * N * obs_dim, dtype=np.float32).reshape(T + 1, N, obs_dim) + fill)
    terminated = np.zeros((T, N), bool)
    final_index, final_obs = np.zeros(0, np.int64), np.zeros((0, obs_dim), np.float32)
    if done_at is not None:
        t, n = done_at
        terminated[t, n] = True
        final_index = np.array([t * N + n], np.int64)
        final_obs = np.full((1, obs_dim), -1.0, np.float32)
    return build_fragment(
        actor_id=actor_id, seq=seq, policy_version=version, algorithm=algorithm, env_ids=range(N), obs=obs,
        actions=np.ones((T, N), np.int64), rewards=np.ones((T, N), np.float32), terminated=terminated,
        truncated=np.zeros((T, N), bool), final_obs=final_obs, final_index=final_index,
        extras={"behaviour_logprob": np.full((T, N), -0.7, np.float32)} if algorithm == pb.ALGORITHM_PPO else None)

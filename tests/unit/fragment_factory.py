"""Builds small, valid trajectory fragments with distinct, traceable values for unit tests.

Layout (flat step index i = t * N + n, `base` shifts every value of one fragment):
  rewards[t, n]   = base + i
  obs[t, n, k]    = (base + t * N + n) * 10 + k    for t in 0..T (row T is the bootstrap row)
  final_obs[j, k] = -((base + final_index[j]) * 10 + k) - 1   (negative: never equal to an obs)
so a transition row's obs[0] is 10 * its reward, and its ordinary next_obs is obs + 10 * N.
"""

from __future__ import annotations

import math

import numpy as np

from kuberl.v1 import common_pb2 as pb
from services.common.fragments import Fragment, build_fragment, decode_fragment

PPO = pb.ALGORITHM_PPO
DQN = pb.ALGORITHM_DQN


def fragment_arrays(T: int = 3, N: int = 2, obs_shape: tuple[int, ...] = (3,), *, base: int = 0,
                    terminated=None, truncated=None, obs_dtype=np.float32,
                    with_logprob: bool = True) -> dict[str, np.ndarray]:
    """The arrays of one fragment; `terminated`/`truncated` are lists of (t, n) steps that ended."""
    k = math.prod(obs_shape)
    feat = np.arange(k).reshape(obs_shape) if obs_shape else np.zeros(())
    step = base + np.arange((T + 1) * N).reshape(T + 1, N)
    obs = (step.reshape(T + 1, N, *([1] * len(obs_shape))) * 10 + feat).astype(obs_dtype)
    term = np.zeros((T, N), bool)
    trunc = np.zeros((T, N), bool)
    for t, n in terminated or ():
        term[t, n] = True
    for t, n in truncated or ():
        trunc[t, n] = True
    final_index = np.flatnonzero((term | trunc).reshape(-1)).astype(np.int64)
    final_step = (base + final_index).reshape(-1, *([1] * len(obs_shape)))
    final_obs = (-(final_step * 10 + feat) - 1).astype(obs_dtype).reshape(len(final_index), *obs_shape)
    out = dict(obs=obs, actions=(np.arange(T * N) % 2).reshape(T, N).astype(np.int64),
               rewards=(base + np.arange(T * N)).reshape(T, N).astype(np.float32),
               terminated=term, truncated=trunc, final_obs=final_obs, final_index=final_index)
    if with_logprob:
        out["behaviour_logprob"] = np.full((T, N), np.log(0.5), np.float32)
    return out


def make_msg(T: int = 3, N: int = 2, obs_shape: tuple[int, ...] = (3,), *, algorithm: int = PPO,
             actor_id: str = "actor-0", seq: int = 0, policy_version: int = 0, base: int = 0,
             terminated=None, truncated=None, obs_dtype=np.float32, incarnation: int = 0) -> pb.TrajectoryFragment:
    arrays = fragment_arrays(T, N, obs_shape, base=base, terminated=terminated, truncated=truncated,
                             obs_dtype=obs_dtype, with_logprob=algorithm == PPO)
    return build_fragment(actor_id=actor_id, seq=seq, policy_version=policy_version, algorithm=algorithm,
                          env_ids=range(N), incarnation=incarnation, **arrays)


def make_fragment(*args, **kwargs) -> Fragment:
    return decode_fragment(make_msg(*args, **kwargs))

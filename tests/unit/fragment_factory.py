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
from services.common.protocol.fragments import Fragment, build_fragment, decode_fragment

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
        out["extras"] = {"behaviour_logprob": np.full((T, N), np.log(0.5), np.float32)}
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


class FrameEnvs:
    """N envs of an Atari-like game in miniature: observations are stacks of `stack` random uint8
    frames, stack axis first; each step appends a new frame and drops the oldest (or, with
    shift=False, draws a whole new stack: the chain check must not match it). Each step ends its
    episode with probability `p_end` (terminated or truncated, half each); the next starts from
    `stack` new frames. Random content: a wrong frame cannot equal the right one by accident."""

    def __init__(self, n: int, *, stack: int = 4, frame: tuple[int, ...] = (6, 6), p_end: float = 0.1,
                 shift: bool = True, seed: int = 0):
        self.rng = np.random.default_rng(seed)
        self.shape, self.p_end, self.shift = (stack, *frame), p_end, shift
        self.stacks = [self._frames(stack) for _ in range(n)]

    def _frames(self, count: int) -> np.ndarray:
        return self.rng.integers(0, 256, (count, *self.shape[1:]), dtype=np.uint8)

    def fragment(self, T: int, *, actor_id: str = "actor-0", seq: int = 0, incarnation: int = 0,
                 policy_version: int = 0, env_ids=None) -> pb.TrajectoryFragment:
        """The next T steps of every env as one DQN fragment."""
        N = len(self.stacks)
        obs = np.empty((T + 1, N, *self.shape), np.uint8)
        ended = np.zeros((2, T, N), bool)  # terminated, truncated
        finals = []
        obs[0] = self.stacks
        for t in range(T):
            for n in range(N):
                old = self.stacks[n]
                nxt = np.concatenate([old[1:], self._frames(1)]) if self.shift else self._frames(len(old))
                if self.rng.random() < self.p_end:
                    ended[int(self.rng.random() < 0.5), t, n] = True
                    finals.append(nxt)
                    nxt = self._frames(len(old))
                self.stacks[n] = obs[t + 1, n] = nxt
        final_index = np.flatnonzero((ended[0] | ended[1]).reshape(-1)).astype(np.int64)
        return build_fragment(actor_id=actor_id, seq=seq, policy_version=policy_version, algorithm=DQN,
                              env_ids=range(N) if env_ids is None else env_ids, incarnation=incarnation, obs=obs,
                              actions=self.rng.integers(0, 6, (T, N)),
                              rewards=self.rng.normal(size=(T, N)).astype(np.float32),
                              terminated=ended[0], truncated=ended[1],
                              final_obs=np.array(finals, np.uint8).reshape(-1, *self.shape), final_index=final_index)


def transition_batch(actions, obs_dim: int, B: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    """B random transitions of a TransitionBatch as read-only arrays, as a learner decodes them off the
    wire; `actions(rng, B)` draws the actions (after obs, before rewards)."""
    from services.common.protocol.tensors import decode, encode

    rng = np.random.default_rng(seed)
    arrays = {"obs": rng.standard_normal((B, obs_dim)).astype(np.float32),
              "actions": actions(rng, B),
              "rewards": rng.standard_normal(B).astype(np.float32),
              "next_obs": rng.standard_normal((B, obs_dim)).astype(np.float32),
              "terminated": rng.random(B) < 0.5,
              "policy_version": np.zeros(B, np.int64)}
    return {k: decode(encode(v), k) for k, v in arrays.items()}

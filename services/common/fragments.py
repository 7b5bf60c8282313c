"""The trajectory-fragment layout: built by actors, validated and decoded by buffers and learners.

A fragment holds T steps of N envs, time-major (see TrajectoryFragment in common.proto). This module
is the only place that knows which tensor goes where; `decode_fragment` checks every invariant the
proto documents and raises TensorError naming the field, before any data is stored.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kuberl.v1 import common_pb2 as pb
from services.common.tensors import DEFAULT_MAX_ELEMENTS, TensorError, decode, encode

MAX_STEPS = 65536
MAX_ID_LEN = 128
ALGORITHM_NAMES = {pb.ALGORITHM_DQN: "dqn", pb.ALGORITHM_PPO: "ppo"}
ALGORITHM_CODES = {name: code for code, name in ALGORITHM_NAMES.items()}
# The tensors of a TransitionBatch (common.proto), in declaration order.
TRANSITION_FIELDS = ("obs", "actions", "rewards", "next_obs", "terminated", "policy_version")


@dataclass(frozen=True)
class Fragment:
    """A validated fragment as read-only numpy views. Shapes as in TrajectoryFragment."""

    actor_id: str
    seq: int
    policy_version: int
    algorithm: int
    env_ids: tuple[int, ...]
    obs: np.ndarray                # [T+1, N, *obs_shape]
    actions: np.ndarray            # [T, N, *action_shape]
    rewards: np.ndarray            # [T, N] float32
    terminated: np.ndarray         # [T, N] bool
    truncated: np.ndarray          # [T, N] bool
    final_obs: np.ndarray          # [K, *obs_shape]
    final_index: np.ndarray        # [K] int64, flat t * N + n
    behaviour_logprob: np.ndarray | None  # [T, N] float32 (PPO)

    @property
    def num_steps(self) -> int:
        return self.rewards.shape[0]

    @property
    def num_envs(self) -> int:
        return self.rewards.shape[1]

    @property
    def num_samples(self) -> int:
        """Transitions in the fragment: T * N."""
        return self.rewards.size

    def next_obs(self) -> np.ndarray:
        """[T, N, *obs_shape]: the observation after each step; the true final one where an episode ended."""
        nxt = self.obs[1:].copy()
        if len(self.final_index):
            flat = nxt.reshape(self.num_samples, *nxt.shape[2:])
            flat[self.final_index] = self.final_obs
        return nxt


def build_fragment(*, actor_id: str, seq: int, policy_version: int, algorithm: int, env_ids,
                   obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, terminated: np.ndarray,
                   truncated: np.ndarray, final_obs: np.ndarray, final_index: np.ndarray,
                   behaviour_logprob: np.ndarray | None = None) -> pb.TrajectoryFragment:
    """Encode one fragment (arrays shaped as in TrajectoryFragment) into its wire message."""
    msg = pb.TrajectoryFragment(actor_id=actor_id, seq=seq, policy_version=policy_version,
                                algorithm=algorithm, env_ids=list(env_ids),
                                num_steps=rewards.shape[0], created_unix_s=time.time())
    encode(obs, msg.obs)
    encode(actions, msg.actions)
    encode(rewards.astype(np.float32, copy=False), msg.rewards)
    encode(terminated.astype(bool, copy=False), msg.terminated)
    encode(truncated.astype(bool, copy=False), msg.truncated)
    encode(final_obs, msg.final_obs)
    encode(final_index.astype(np.int64, copy=False), msg.final_index)
    if behaviour_logprob is not None:
        encode(behaviour_logprob.astype(np.float32, copy=False), msg.behaviour_logprob)
    return msg


def _expect(cond: bool, field: str, message: str) -> None:
    if not cond:
        raise TensorError(field, message)


def decode_fragment(msg: pb.TrajectoryFragment, *, algorithm: int | None = None,
                    max_elements: int = DEFAULT_MAX_ELEMENTS) -> Fragment:
    """Validate a TrajectoryFragment and return it decoded (zero-copy views of its bytes).

    `algorithm`, when given, is the only algorithm accepted. Raises TensorError naming the field.
    """
    _expect(0 < len(msg.actor_id) <= MAX_ID_LEN, "actor_id", f"must be 1..{MAX_ID_LEN} characters")
    _expect(msg.algorithm in ALGORITHM_NAMES, "algorithm", f"unknown or unspecified algorithm {msg.algorithm}")
    if algorithm is not None and msg.algorithm != algorithm:
        raise TensorError("algorithm", f"fragment is for {ALGORITHM_NAMES[msg.algorithm]} but this "
                                       f"receiver serves {ALGORITHM_NAMES.get(algorithm, algorithm)}")
    T, N = msg.num_steps, len(msg.env_ids)
    _expect(0 < T <= MAX_STEPS, "num_steps", f"{T} is outside 1..{MAX_STEPS}")
    _expect(N > 0, "env_ids", "must name at least one env")

    def get(name: str, present: bool = True) -> np.ndarray | None:
        if not msg.HasField(name):
            _expect(not present, name, "is required but missing")
            return None
        return decode(getattr(msg, name), name, max_elements)

    obs = get("obs")
    _expect(obs.ndim >= 2 and obs.shape[:2] == (T + 1, N), "obs.shape",
            f"must start with [T+1={T + 1}, N={N}], got {list(obs.shape)}")
    actions = get("actions")
    _expect(actions.ndim >= 2 and actions.shape[:2] == (T, N), "actions.shape",
            f"must start with [T={T}, N={N}], got {list(actions.shape)}")
    step_fields = {}
    for name, dtype in (("rewards", np.float32), ("terminated", np.bool_), ("truncated", np.bool_)):
        arr = get(name)
        _expect(arr.shape == (T, N), f"{name}.shape", f"must be [T={T}, N={N}], got {list(arr.shape)}")
        _expect(arr.dtype == dtype, f"{name}.dtype", f"must be {np.dtype(dtype).name}, got {arr.dtype.name}")
        step_fields[name] = arr
    _expect(bool(np.isfinite(step_fields["rewards"]).all()), "rewards", "holds NaN or infinity")

    final_index = get("final_index")
    _expect(final_index.ndim == 1 and final_index.dtype == np.int64, "final_index",
            f"must be a 1-d int64 tensor, got {final_index.dtype.name} {list(final_index.shape)}")
    done = np.flatnonzero((step_fields["terminated"] | step_fields["truncated"]).reshape(-1))
    _expect(np.array_equal(np.sort(final_index), done), "final_index",
            f"must list each of the {len(done)} steps that ended an episode exactly once")
    final_obs = get("final_obs")
    _expect(final_obs.shape == (len(final_index), *obs.shape[2:]) and final_obs.dtype == obs.dtype,
            "final_obs", f"must be {obs.dtype.name} [K={len(final_index)}, *obs_shape={list(obs.shape[2:])}], "
                         f"got {final_obs.dtype.name} {list(final_obs.shape)}")

    logprob = get("behaviour_logprob", present=msg.algorithm == pb.ALGORITHM_PPO)
    if logprob is not None:
        _expect(logprob.shape == (T, N) and logprob.dtype == np.float32, "behaviour_logprob",
                f"must be float32 [T={T}, N={N}], got {logprob.dtype.name} {list(logprob.shape)}")
    return Fragment(actor_id=msg.actor_id, seq=msg.seq, policy_version=msg.policy_version,
                    algorithm=msg.algorithm, env_ids=tuple(msg.env_ids), obs=obs, actions=actions,
                    final_obs=final_obs, final_index=final_index, behaviour_logprob=logprob, **step_fields)


def batch_samples(batch: pb.TrainingBatch) -> int:
    """Samples in a TrainingBatch as its wire header says (transitions, or steps of all fragments)."""
    if batch.HasField("transitions"):
        shape = batch.transitions.rewards.shape
        return int(shape[0]) if len(shape) else 0
    return sum(f.num_steps * len(f.env_ids) for f in batch.rollouts.fragments)

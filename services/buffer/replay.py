"""Uniform replay ring of transitions for off-policy learners (DQN). Numpy only.

Storage is allocated on the first insert, from its shapes and dtypes; later inserts must match
(a mismatch raises TensorError naming the field). When full, the oldest transitions are overwritten.

The ring can be checkpointed (services/buffer/checkpoint.py) while it keeps taking inserts: `mark`
and `spans_since` tell which rows were written after a point, so a copy taken concurrently can be
patched into a consistent one; `state` and `restore` carry the insert position, the size and the
sampling RNG, so that sampling after a restore continues exactly where it was.
"""

from __future__ import annotations

import numpy as np

from services.common.fragments import TRANSITION_FIELDS, Fragment
from services.common.tensors import TensorError


class ReplayRing:
    def __init__(self, capacity: int, seed: int = 0):
        self.capacity = capacity
        self.size = 0
        self._next = 0
        self._data: dict[str, np.ndarray] | None = None
        self._rng = np.random.default_rng(seed)
        self.written = 0  # rows ever written (never wraps): marks for checkpoint copies

    def _allocate(self, rows: dict[str, np.ndarray]) -> None:
        self._data = {k: np.empty((self.capacity, *v.shape[1:]), dtype=v.dtype) for k, v in rows.items()}

    def check(self, frag: Fragment) -> None:
        """Raise TensorError if `frag` does not fit the stored shapes/dtypes (no side effects)."""
        if self._data is None:
            return
        for name, arr in (("obs", frag.obs), ("actions", frag.actions)):
            want = self._data[name]
            if arr.shape[2:] != want.shape[1:] or arr.dtype != want.dtype:
                raise TensorError(name, f"{arr.dtype.name} {list(arr.shape[2:])} per step differs from "
                                        f"this buffer's {want.dtype.name} {list(want.shape[1:])}")

    def add(self, frag: Fragment) -> int:
        """Append the fragment's T*N transitions; returns how many were added."""
        n = frag.num_samples
        rows = {
            "obs": frag.obs[:-1].reshape(n, *frag.obs.shape[2:]),
            "actions": frag.actions.reshape(n, *frag.actions.shape[2:]),
            "rewards": frag.rewards.reshape(n),
            "next_obs": frag.next_obs().reshape(n, *frag.obs.shape[2:]),
            "terminated": frag.terminated.reshape(n),
            "policy_version": np.full(n, frag.policy_version, dtype=np.int64),
        }
        if self._data is None:
            self._allocate(rows)
        self.check(frag)
        # Wrap-around write in at most two slices; a fragment larger than the ring keeps its tail.
        start = max(0, n - self.capacity)
        idx = (self._next + np.arange(n - start)) % self.capacity
        for k, v in rows.items():
            self._data[k][idx] = v[start:]
        self._next = (self._next + n - start) % self.capacity
        self.size = min(self.capacity, self.size + n - start)
        self.written += n - start
        return n

    def sample(self, batch_size: int) -> dict[str, np.ndarray]:
        """Uniformly sample `batch_size` transitions (with replacement) as fresh arrays."""
        if self.size == 0 or self._data is None:
            raise ValueError("cannot sample from an empty replay ring")
        idx = self._rng.integers(0, self.size, batch_size)
        return {k: v[idx] for k, v in self._data.items()}

    # --- checkpoints --------------------------------------------------------------------------------

    @property
    def data(self) -> dict[str, np.ndarray] | None:
        """The storage arrays (capacity rows each; the first `size` hold transitions), None before the
        first insert. Live: read them, never write them."""
        return self._data

    def mark(self) -> tuple[int, int]:
        """A point in the ring's history, for `spans_since`."""
        return self.written, self._next

    def spans_since(self, mark: tuple[int, int]) -> list[tuple[int, int]]:
        """The rows written after `mark`, as at most two [start, stop) spans (writes go round the ring
        in order); all of [0, size) when the ring went all the way round since."""
        written, start = mark
        n = self.written - written
        if n >= self.capacity:
            return [(0, self.size)]
        end = start + n
        return [(start, end)] if end <= self.capacity else [(start, self.capacity), (0, end - self.capacity)]

    def state(self) -> dict:
        """Capacity, size, insert position and the sampling RNG's state, as plain (JSON-able) values."""
        return {"capacity": self.capacity, "size": self.size, "next": self._next,
                "rng": self._rng.bit_generator.state}

    def restore(self, arrays: dict[str, np.ndarray], state: dict) -> None:
        """Take over the contents of a checkpoint: `arrays` hold the first `state["size"]` rows of a
        ring of `state["capacity"]` rows, `state` is what `state()` returned. Raises ValueError (and
        changes nothing) if they do not describe a ring. A checkpoint of a ring of another capacity
        keeps its newest transitions, as many as fit."""
        capacity, size, nxt = (int(state[k]) for k in ("capacity", "size", "next"))
        if arrays or size:  # an empty ring (never inserted into) has no arrays
            self._check_restorable(arrays, capacity, size, nxt)
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]  # raises ValueError/TypeError if it is not a PCG64 state
        if size == 0:
            self._data, self.size, self._next, self.written, self._rng = None, 0, 0, 0, rng
            return
        if capacity == self.capacity:  # same geometry: rows stay where they were (and sampling replays)
            keep = size
            data = {k: v if size == capacity and v.flags.writeable and v.flags.c_contiguous else _grown(v, capacity)
                    for k, v in arrays.items()}  # a full ring takes the loaded arrays as they are: no copy
        else:
            order = np.arange(size) if size < capacity else (nxt + np.arange(size)) % capacity  # oldest first
            rows = order[-self.capacity:]
            keep, nxt = len(rows), len(rows) % self.capacity
            data = {k: _grown(v[rows], self.capacity) for k, v in arrays.items()}
        self._data, self.size, self._next, self._rng = data, keep, nxt, rng
        self.written = self.size

    @staticmethod
    def _check_restorable(arrays: dict[str, np.ndarray], capacity: int, size: int, nxt: int) -> None:
        if set(arrays) != set(TRANSITION_FIELDS):
            raise ValueError(f"fields {sorted(arrays)} are not a replay ring's {sorted(TRANSITION_FIELDS)}")
        if not 0 <= size <= capacity or not 0 <= nxt < max(capacity, 1) or (size < capacity and nxt != size % capacity):
            raise ValueError(f"size {size} and insert position {nxt} do not fit a ring of {capacity}")
        for name, arr in arrays.items():
            if arr.ndim < 1 or len(arr) != size:
                raise ValueError(f"{name}: {len(arr) if arr.ndim else 'no'} rows, expected {size}")
        obs, next_obs = arrays["obs"], arrays["next_obs"]
        if obs.shape[1:] != next_obs.shape[1:] or obs.dtype != next_obs.dtype:
            raise ValueError(f"obs {obs.dtype.name} {list(obs.shape[1:])} and next_obs {next_obs.dtype.name} "
                             f"{list(next_obs.shape[1:])} differ")
        if any(arrays[k].ndim != 1 for k in ("rewards", "terminated", "policy_version")):
            raise ValueError("rewards, terminated and policy_version must hold one value per transition")


def _grown(rows: np.ndarray, capacity: int) -> np.ndarray:
    """`rows` at the start of a new array of `capacity` rows."""
    out = np.empty((capacity, *rows.shape[1:]), dtype=rows.dtype)
    out[:len(rows)] = rows
    return out

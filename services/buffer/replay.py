"""Uniform replay ring of transitions for off-policy learners (DQN). Numpy only.

Storage is allocated on the first insert, from its shapes and dtypes; later inserts must match
(a mismatch raises TensorError naming the field). When full, the oldest transitions are overwritten.
"""

from __future__ import annotations

import numpy as np

from services.common.fragments import Fragment
from services.common.tensors import TensorError


class ReplayRing:
    def __init__(self, capacity: int, seed: int = 0):
        self.capacity = capacity
        self.size = 0
        self._next = 0
        self._data: dict[str, np.ndarray] | None = None
        self._rng = np.random.default_rng(seed)

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
        return n

    def sample(self, batch_size: int) -> dict[str, np.ndarray]:
        """Uniformly sample `batch_size` transitions (with replacement) as fresh arrays."""
        if self.size == 0 or self._data is None:
            raise ValueError("cannot sample from an empty replay ring")
        idx = self._rng.integers(0, self.size, batch_size)
        return {k: v[idx] for k, v in self._data.items()}

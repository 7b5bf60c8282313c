"""Uniform replay of transitions for off-policy learners (DQN). Numpy only.

Two layouts behind one interface, `Replay` (what the Store and services/buffer/checkpoint.py use):
`ReplayRing` here keeps every transition's obs and next_obs as they came; `CompactReplay`
(services/buffer/compact.py) keeps stacked frames once each and rebuilds the stacks when sampling
(docs/architecture.md section 2, "Replay storage"). The Store picks one at the first insert
(`buffer.compact_replay`). Both sample the same dict with the same dtypes and shapes.

Storage is allocated on the first insert, from its shapes and dtypes; later inserts must match
(a mismatch raises TensorError naming the field). When full, the oldest transitions are overwritten.

N-step returns (`n_step` > 1, DQN's `dqn.n_step`): each stored transition sums up to n rewards,
r_t + g r_t+1 + ... + g^(k-1) r_t+k-1, and its next_obs, terminated and `discount` (g^k, the weight
of the bootstrap) are those of its k-th step. The window stops early where the episode ends
(terminated: no bootstrap; truncated: the bootstrap from the final observation, as for one step)
and at the fragment's last step (each env column of a fragment is one stretch of its stream; the
rows of a fragment's last n-1 steps sum fewer rewards, each with its own g^k, which keeps them exact).
With one step nothing changes: no `discount` is stored and the learner uses its gamma.

The ring can be checkpointed (services/buffer/checkpoint.py) while it keeps taking inserts: `mark`
and `spans_since` tell which rows of which storage array were written after a point, so a copy taken
concurrently can be patched into a consistent one; `state` and `restore` carry the insert position,
the size and the sampling RNG, so that sampling after a restore continues exactly where it was.
"""

from __future__ import annotations

import numpy as np

from services.common.protocol.fragments import Fragment
from services.common.protocol.tensors import TensorError

Spans = dict[str, list[tuple[int, int]]]  # storage array -> [start, stop) row ranges


class Replay:
    """A uniform replay of transitions: what the Store samples from and checkpoints copy.

    `capacity` transitions at most; `size` held now; `evicted_early` counts transitions dropped
    before `capacity` newer ones pushed them out (a ring that ran out of another resource: see
    CompactReplay), never done by ReplayRing. Subclasses store and gather; sampling is shared, so
    both layouts draw the same rows from the same RNG state.
    """

    kind = ""  # the layout, in a checkpoint's ring state ("" for ReplayRing: older files have none)

    def __init__(self, capacity: int, seed: int = 0, *, n_step: int = 1, gamma: float = 1.0):
        self.capacity = capacity
        self.n_step, self.gamma = n_step, gamma  # the returns each transition holds (module docstring)
        self.size = 0
        self.evicted_early = 0
        self._rng = np.random.default_rng(seed)

    def add(self, frag: Fragment) -> int:
        """Append the fragment's T*N transitions (checked first: nothing stored if refused)."""
        raise NotImplementedError

    def layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]] | None:
        """Per-step shape and dtype of "obs" and "actions" as stored; None before the first insert."""
        raise NotImplementedError

    def gather(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """The transitions at positions `rows` of [0, size) (each layout's own order) as fresh arrays,
        keyed and ordered as TRANSITION_FIELDS."""
        raise NotImplementedError

    def check(self, frag: Fragment) -> None:
        """Raise TensorError if `frag` does not fit the stored shapes/dtypes (no side effects)."""
        layout = self.layout()
        if layout is None:
            return
        for name, arr in (("obs", frag.obs), ("actions", frag.actions)):
            shape, dtype = layout[name]
            if arr.shape[2:] != shape or arr.dtype != dtype:
                raise TensorError(name, f"{arr.dtype.name} {list(arr.shape[2:])} per step differs from "
                                        f"this buffer's {dtype.name} {list(shape)}")

    def sample(self, batch_size: int) -> dict[str, np.ndarray]:
        """Uniformly sample `batch_size` transitions (with replacement) as fresh arrays."""
        if self.size == 0 or self.data is None:
            raise ValueError("cannot sample from an empty replay ring")
        return self.gather(self._rng.integers(0, self.size, batch_size))

    def nbytes(self) -> int:
        """Bytes of storage allocated (np.empty: pages are taken as rows are written), 0 before the
        first insert."""
        return sum(a.nbytes for a in (self.data or {}).values())

    def replaced_by(self, cls: type[Replay]) -> Replay:
        """An empty replay of layout `cls` with this one's capacity and sampling RNG (which a restore
        may have set): the Store's choice of layout at the first insert."""
        if self.data is not None:
            raise ValueError("a replay that holds transitions keeps its layout")
        other = cls(self.capacity, n_step=self.n_step, gamma=self.gamma)
        other._rng = self._rng
        return other

    @property
    def row_fields(self) -> tuple[str, ...]:
        """The per-transition fields other than observations: what `step_fields` gives."""
        return ("actions", "rewards", "terminated", "policy_version", *(("discount",) if self.n_step > 1 else ()))

    def returns_state(self) -> dict:
        return {"n_step": self.n_step, "gamma": self.gamma}

    def check_returns(self, state: dict) -> None:
        """Raise ValueError unless a checkpoint's transitions hold the returns this replay makes."""
        n, gamma = int(state.get("n_step", 1)), float(state.get("gamma", self.gamma))
        if n != self.n_step or (n > 1 and gamma != self.gamma):
            raise ValueError(f"its transitions hold {n}-step returns" + (f" with gamma {gamma}" if n > 1 else "")
                             + f"; this buffer makes {self.n_step}-step returns"
                             + (f" with gamma {self.gamma}" if self.n_step > 1 else "")
                             + " (dqn.n_step, dqn.gamma)")

    # --- checkpoints (services/buffer/checkpoint.py) -------------------------------------------------

    @property
    def data(self) -> dict[str, np.ndarray] | None:
        """The storage arrays, None before the first insert. Live: read them, never write them."""
        raise NotImplementedError

    def used(self) -> dict[str, int]:
        """How many leading rows of each storage array hold data (what a checkpoint copies)."""
        raise NotImplementedError

    def mark(self) -> tuple:
        """A point in the ring's history, for `spans_since`."""
        raise NotImplementedError

    def spans_since(self, mark: tuple) -> Spans:
        """The rows of each storage array written after `mark`."""
        raise NotImplementedError

    def state(self) -> dict:
        """Positions, sizes and the sampling RNG's state, as plain (JSON-able) values."""
        raise NotImplementedError

    def restore(self, arrays: dict[str, np.ndarray], state: dict) -> None:
        """Take over a checkpoint: `arrays` hold the `used()` rows of each storage array, `state` is
        what `state()` returned. Raises ValueError (and changes nothing) if they do not fit together."""
        raise NotImplementedError


def n_step_returns(rewards: np.ndarray, terminated: np.ndarray, truncated: np.ndarray, n: int,
                   gamma: float) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """N-step returns over [T, N] steps (module docstring): (returns float32, terminated, discount
    g^k float32, last), where `last` [T, N] is the step t + k - 1 whose next observation and end each
    transition takes."""
    T, N = rewards.shape
    ends = terminated | truncated
    total = rewards.astype(np.float64)
    last = np.broadcast_to(np.arange(T)[:, None], (T, N)).copy()
    open_ = ~ends                     # the window of (t, n) may take step last + 1
    for i in range(1, min(n, T)):     # (a fragment, or a part of one, may be shorter than n)
        go = open_[:T - i]            # rows t whose window reaches step t + i (inside the fragment)
        t, col = np.nonzero(go)
        total[t, col] += gamma ** i * rewards[t + i, col]
        last[t, col] = t + i
        open_[:T - i] = go & ~ends[i:]
        open_[T - i:] = False
    k = last - np.arange(T)[:, None] + 1
    rows = np.arange(N)
    return (total.astype(np.float32), terminated[last, rows], (gamma ** k).astype(np.float32), last)


def step_fields(frag: Fragment, steps: slice = slice(None), envs: slice = slice(None), *, n_step: int = 1,
                gamma: float = 1.0) -> tuple[dict[str, np.ndarray], np.ndarray | None]:
    """The per-transition fields other than observations of frag[steps, envs], flat in time-major
    (t * N + n) order: what every layout stores. With `n_step` > 1, rewards, terminated and
    `discount` are n-step ones, and the second value gives, per transition, the flat position within
    frag[steps, envs] of the step whose next observation it takes (None for one step)."""
    def flat(arr: np.ndarray) -> np.ndarray:
        return arr.reshape(arr.shape[0] * arr.shape[1], *arr.shape[2:])
    rewards, terminated = frag.rewards[steps, envs], frag.terminated[steps, envs]
    fields = {"actions": flat(frag.actions[steps, envs]), "rewards": flat(rewards), "terminated": flat(terminated),
              "policy_version": np.full(rewards.size, frag.policy_version, dtype=np.int64)}
    if n_step == 1:
        return fields, None
    returns, ended, discount, last = n_step_returns(rewards, terminated, frag.truncated[steps, envs], n_step, gamma)
    fields.update(rewards=flat(returns), terminated=flat(ended), discount=flat(discount))
    return fields, flat(last * rewards.shape[1] + np.arange(rewards.shape[1]))


def ring_spans(start: int, count: int, capacity: int, used: int) -> list[tuple[int, int]]:
    """The positions of `count` rows written in order from position `start` of a ring of `capacity`:
    at most two [start, stop) spans, or all `used` rows when the writes went all the way round."""
    if count >= capacity:
        return [(0, used)]
    end = start + count
    return [(start, end)] if end <= capacity else [(start, capacity), (0, end - capacity)]


class ReplayRing(Replay):
    """Every transition's obs and next_obs stored as they came: any observation, twice the frames."""

    def __init__(self, capacity: int, seed: int = 0, *, n_step: int = 1, gamma: float = 1.0):
        super().__init__(capacity, seed, n_step=n_step, gamma=gamma)
        self._next = 0
        self._data: dict[str, np.ndarray] | None = None
        self.written = 0  # rows ever written (never wraps): marks for checkpoint copies

    def _allocate(self, rows: dict[str, np.ndarray]) -> None:
        self._data = {k: np.empty((self.capacity, *v.shape[1:]), dtype=v.dtype) for k, v in rows.items()}

    def layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]] | None:
        if self._data is None:
            return None
        return {name: (self._data[name].shape[1:], self._data[name].dtype) for name in ("obs", "actions")}

    def add(self, frag: Fragment) -> int:
        """Append the fragment's T*N transitions; returns how many were added."""
        n = frag.num_samples
        fields, last = step_fields(frag, n_step=self.n_step, gamma=self.gamma)
        next_obs = frag.next_obs().reshape(n, *frag.obs.shape[2:])
        rows = {"obs": frag.obs[:-1].reshape(n, *frag.obs.shape[2:]), "actions": fields.pop("actions"),
                "rewards": fields.pop("rewards"), "next_obs": next_obs if last is None else next_obs[last],
                **fields}  # TRANSITION_FIELDS' order (then discount), as gather gives them
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

    def gather(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        return {k: v[rows] for k, v in self._data.items()}  # rows [0, size) are stored at [0, size)

    # --- checkpoints --------------------------------------------------------------------------------

    @property
    def data(self) -> dict[str, np.ndarray] | None:
        """The storage arrays (capacity rows each; the first `size` hold transitions), None before the
        first insert. Live: read them, never write them."""
        return self._data

    def used(self) -> dict[str, int]:
        return dict.fromkeys(self._data or (), self.size)

    def mark(self) -> tuple[int, int]:
        return self.written, self._next

    def spans_since(self, mark: tuple[int, int]) -> Spans:
        """The rows written after `mark`: at most two spans of every array (writes go round the ring
        in order); all of [0, size) when the ring went all the way round since."""
        written, start = mark
        spans = ring_spans(start, self.written - written, self.capacity, self.size)
        return dict.fromkeys(self._data or (), spans)

    def state(self) -> dict:
        """Capacity, size, insert position and the sampling RNG's state, as plain (JSON-able) values."""
        return {"capacity": self.capacity, "size": self.size, "next": self._next,
                "rng": self._rng.bit_generator.state, **self.returns_state()}

    def restore(self, arrays: dict[str, np.ndarray], state: dict) -> None:
        """Take over the contents of a checkpoint: `arrays` hold the first `state["size"]` rows of a
        ring of `state["capacity"]` rows, `state` is what `state()` returned. Raises ValueError (and
        changes nothing) if they do not describe a ring. A checkpoint of a ring of another capacity
        keeps its newest transitions, as many as fit."""
        if state.get("kind", "") != self.kind:
            raise ValueError(f"it holds a {state.get('kind')!r} replay, not a ReplayRing")
        capacity, size, nxt = (int(state[k]) for k in ("capacity", "size", "next"))
        if arrays or size:  # an empty ring (never inserted into) has no arrays
            self.check_returns(state)
            self._check_restorable(arrays, capacity, size, nxt, ("obs", "next_obs", *self.row_fields))
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]  # raises ValueError/TypeError if it is not a PCG64 state
        if size == 0:
            self._data, self.size, self._next, self.written, self._rng = None, 0, 0, 0, rng
            return
        if capacity == self.capacity:  # same geometry: rows stay where they were (and sampling replays)
            keep = size
            data = {k: taken(v, capacity) for k, v in arrays.items()}
        else:
            order = np.arange(size) if size < capacity else (nxt + np.arange(size)) % capacity  # oldest first
            rows = order[-self.capacity:]
            keep, nxt = len(rows), len(rows) % self.capacity
            data = {k: grown(v[rows], self.capacity) for k, v in arrays.items()}
        self._data, self.size, self._next, self._rng = data, keep, nxt, rng
        self.written = self.size

    @staticmethod
    def _check_restorable(arrays: dict[str, np.ndarray], capacity: int, size: int, nxt: int,
                          fields: tuple[str, ...]) -> None:
        if set(arrays) != set(fields):
            raise ValueError(f"fields {sorted(arrays)} are not a replay ring's {sorted(fields)}")
        if not 0 <= size <= capacity or not 0 <= nxt < max(capacity, 1) or (size < capacity and nxt != size % capacity):
            raise ValueError(f"size {size} and insert position {nxt} do not fit a ring of {capacity}")
        for name, arr in arrays.items():
            if arr.ndim < 1 or len(arr) != size:
                raise ValueError(f"{name}: {len(arr) if arr.ndim else 'no'} rows, expected {size}")
        obs, next_obs = arrays["obs"], arrays["next_obs"]
        if obs.shape[1:] != next_obs.shape[1:] or obs.dtype != next_obs.dtype:
            raise ValueError(f"obs {obs.dtype.name} {list(obs.shape[1:])} and next_obs {next_obs.dtype.name} "
                             f"{list(next_obs.shape[1:])} differ")
        if any(arrays[k].ndim != 1 for k in ("rewards", "terminated", "policy_version", "discount") if k in arrays):
            raise ValueError("rewards, terminated, policy_version and discount must hold one value per transition")


def grown(rows: np.ndarray, capacity: int) -> np.ndarray:
    """`rows` at the start of a new array of `capacity` rows."""
    out = np.empty((capacity, *rows.shape[1:]), dtype=rows.dtype)
    out[:len(rows)] = rows
    return out


def taken(loaded: np.ndarray, capacity: int) -> np.ndarray:
    """A loaded storage array as a ring's: as it is when whole and writeable (a full ring restores
    without a copy), else copied into one of `capacity` rows."""
    whole = len(loaded) == capacity and loaded.flags.writeable and loaded.flags.c_contiguous
    return loaded if whole else grown(loaded, capacity)

"""Replay that keeps each stacked frame once (docs/architecture.md section 2, "Replay storage").

Why. An Atari observation is a stack of the last K frames (uint8 [4, 84, 84], stack axis first,
services/common/envs.py), and an env's next observation shares K-1 of them. ReplayRing keeps obs and
next_obs of every transition: 2K frames where about one is new, so 1M Pong transitions would take
56 GB. Here frames live once in a frame ring, each transition row holds the numbers of the frames
its obs and next_obs stacks are made of, and the stacks are rebuilt when sampling: about 7.4 KB per
transition instead of 56 KB (docs/benchmarks.md, "Replay memory"). The idea of Dopamine's circular
replay and SB3's `optimize_memory_usage`, which find a stack's frames by position; explicit frame
numbers let a stack go on across fragments and leave nothing to the order fragments arrive in.

Chains. Each env column of a fragment is walked in order: obs[0], then after each step t the
observation it led to (final_obs where the episode ended at t, followed by obs[t+1], the next
episode's first). A stack whose first K-1 frames equal, byte for byte, the last K-1 of the stack
before it stores one new frame and shares the rest; any other (an episode's first, stacks that do
not shift) stores K new frames. A fragment's obs[0] goes on from the stack its (actor_id,
incarnation, env_id) ended the previous fragment with, if those frames are still held, recent (see
Sizing) and equal to it byte for byte, so a steady stream costs one frame per transition; anything
else (a re-send, a restarted actor, fragments out of order) stores K new frames. Whatever the data,
every stack is rebuilt exactly as it came.

Sizing. Frames are numbered in the order they are written (`frames_written`); frame f sits at
f % frames, so the newest `frames` are held. Each row keeps `floor`, the oldest frame it or any
newer row refers to (so floors never decrease from the oldest row to the newest): before frames go
round, the oldest rows are evicted up to the last one whose floor the write would overwrite (a
binary search), and no held transition ever refers to a frame that is gone. `frame_ring_size`:
frames = capacity + capacity/32 (+ a few stacks for small rings), about 1.03 per transition. Pong
writes 1 frame per transition plus K per episode (under 1%), and a chain that goes on from its
env's previous fragment refers back one round of the fleet (every env's fragment since, 16 steps
each), so the `capacity` rows run out first and transitions leave as they would a ReplayRing. A
chain goes on only from frames at most `lag` = capacity/16 old: the rows before one that refers
that far back leave when its frames do, so a slow actor costs at most that much of the ring; a fleet
of more than capacity/512 envs at 16 steps (1,950 at 1M) costs up to capacity/32 of it, and in one
of more than capacity/256 (3,900 at 1M) each fragment starts its chains with K frames. Data that
needs more frames (stacks that do not shift: up to 3K per transition) has transitions leave before
`capacity` newer ones push them out, counted in `evicted_early` (buffer/samples_evicted_early_total,
docs/metrics.md). A fragment that needs more frames than fit at once is stored in parts (halves of
its steps, then of its envs), in order.

Checkpoints: the frame ring and the rows are storage arrays like ReplayRing's (mark/spans_since over
both). Floors are worked out again from the rows at a restore, and the chain ends are not saved (a
restored buffer stores each env's next stack in full once).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from services.buffer.replay import Replay, Spans, grown, ring_spans, step_fields, taken
from services.common.protocol.fragments import Fragment

MAX_CHAINS = 65536  # chain ends remembered, (actor_id, incarnation, env_id), least recently used forgotten
ROW_FIELDS = ("obs_frames", "next_obs_frames", "actions", "rewards", "terminated", "policy_version")


def frame_ring_size(capacity: int, stack: int) -> tuple[int, int]:
    """(frames held, lag) for `capacity` transitions of `stack`-frame observations (module docstring)."""
    return capacity + capacity // 32 + 16 * stack, capacity // 16 + 8 * stack


def _equal(a: np.ndarray, b: np.ndarray, lead: int) -> np.ndarray:
    """Whether a[i] and b[i] hold the same bytes, for each index i of the first `lead` axes (bytes, not
    values: a float -0.0 is not 0.0 here, and a NaN equals itself)."""
    shape = a.shape[:lead]
    size = math.prod(a.shape[lead:])
    return (_words(a.reshape(*shape, size)) == _words(b.reshape(*shape, size))).all(axis=-1)


def _words(x: np.ndarray) -> np.ndarray:
    """The bytes of each row of x's last axis, as 8-byte words where they divide evenly."""
    if x.strides[-1] != x.itemsize:
        x = np.ascontiguousarray(x)
    return x.view(np.uint64 if x.shape[-1] * x.itemsize % 8 == 0 else np.uint8)


def _shifted_stacks(new: np.ndarray, old: np.ndarray, lead: int) -> np.ndarray:
    """For each index of the first `lead` axes: whether new's stack [K, *frame] is old's moved on by
    one frame (new's first K-1 frames are old's last K-1)."""
    keep = (slice(None),) * lead
    return _equal(new[keep + (slice(None, -1),)], old[keep + (slice(1, None),)], lead)


@dataclass
class _Plan:
    """Where one part of a fragment goes: which new frames, and each transition's frame numbers."""
    new_frames: int
    stack_ids: np.ndarray    # per new frame, in write order: the stack it comes from
    frame_of: np.ndarray     # per new frame: its position in that stack
    obs_frames: np.ndarray   # [rows, K]
    next_obs_frames: np.ndarray
    chain_ends: np.ndarray   # [N, K]: each column's last stack, where its next fragment goes on
    final: np.ndarray        # the part's final_obs


class CompactReplay(Replay):
    """Stacked frames stored once, transitions as frame numbers (module docstring)."""

    kind = "compact"

    def __init__(self, capacity: int, seed: int = 0, *, frames: int | None = None, lag: int | None = None,
                 n_step: int = 1, gamma: float = 1.0):
        super().__init__(capacity, seed, n_step=n_step, gamma=gamma)
        self._sizing = (frames, lag)  # None: frame_ring_size's, once the stack depth is known
        self.num_frames = self.lag = self.stack = 0
        self.head = 0                 # the oldest transition's row
        self.rows_written = 0         # transition rows ever written: the next goes to rows_written % capacity
        self.frames_written = 0       # frames ever written: frame f is at f % num_frames
        self._frames: np.ndarray | None = None
        self._rows: dict[str, np.ndarray] | None = None  # ROW_FIELDS (and discount with n-step returns)
        self._floor: np.ndarray | None = None             # per row (module docstring); derived, not saved
        self._chains: OrderedDict[tuple[str, int, int], np.ndarray] = OrderedDict()

    @staticmethod
    def suits(frag: Fragment, always: bool = False) -> bool:
        """Whether `frag`'s observations are stacks this layout keeps: with `always` any that have a
        stack axis; otherwise uint8 stacks of 2-d frames (Atari's) that mostly move on by one frame
        from step to step in this fragment (channel-last images or unstacked colour frames do not)."""
        obs = frag.obs
        if obs.ndim < 3:
            return False
        if always:
            return True
        if obs.dtype != np.uint8 or obs.ndim < 5 or obs.shape[2] < 2:
            return False
        going_on = ~(frag.terminated | frag.truncated)
        shifted = _shifted_stacks(obs[1:], obs[:-1], 2)[going_on]
        return not len(shifted) or shifted.mean() >= 0.5

    def _geometry(self, stack: int) -> tuple[int, int]:
        default = frame_ring_size(self.capacity, stack)
        frames, lag = (d if given is None else given for d, given in zip(default, self._sizing))
        if lag < 0 or frames < 3 * stack:
            raise ValueError(f"a frame ring of {frames} (lag {lag}) cannot hold one transition of {stack}-frame "
                             f"stacks (3 stacks)")
        return frames, lag

    def _allocate(self, frag: Fragment) -> None:
        stack = frag.obs.shape[2]
        self.num_frames, self.lag = self._geometry(stack)
        self.stack = stack
        self._frames = np.empty((self.num_frames, *frag.obs.shape[3:]), dtype=frag.obs.dtype)
        fields, _ = step_fields(frag, n_step=self.n_step, gamma=self.gamma)
        specs = {"obs_frames": ((stack,), np.int64), "next_obs_frames": ((stack,), np.int64),
                 **{k: (v.shape[1:], v.dtype) for k, v in fields.items()}}
        self._rows = {k: np.empty((self.capacity, *shape), dtype=dtype) for k, (shape, dtype) in specs.items()}
        self._floor = np.empty(self.capacity, np.int64)

    def layout(self) -> dict[str, tuple[tuple[int, ...], np.dtype]] | None:
        if self._rows is None:
            return None
        actions = self._rows["actions"]
        return {"obs": ((self.stack, *self._frames.shape[1:]), self._frames.dtype),
                "actions": (actions.shape[1:], actions.dtype)}

    def add(self, frag: Fragment) -> int:
        """Append the fragment's T*N transitions in time-major order; returns how many were added."""
        if self._rows is None:
            self._allocate(frag)
        self.check(frag)
        self._add_part(frag, (0, frag.num_steps), (0, frag.num_envs))
        return frag.num_samples

    def _add_part(self, frag: Fragment, steps: tuple[int, int], envs: tuple[int, int]) -> None:
        (t0, t1), (n0, n1) = steps, envs
        single = t1 - t0 == 1 and n1 - n0 == 1
        # One transition fits as 3 new stacks (_geometry sees to it), if not going on from old frames.
        plan = self._plan(frag, steps, envs) or (self._plan(frag, steps, envs, go_on=False) if single else None)
        if plan is not None:
            self._commit(frag, plan, steps, envs)
        elif t1 - t0 > 1:  # too many new frames at once: in halves, in the same order
            mid = (t0 + t1) // 2
            self._add_part(frag, (t0, mid), envs)
            self._add_part(frag, (mid, t1), envs)
        else:
            mid = (n0 + n1) // 2
            self._add_part(frag, steps, (n0, mid))
            self._add_part(frag, steps, (mid, n1))

    def _plan(self, frag: Fragment, steps: tuple[int, int], envs: tuple[int, int], go_on: bool = True) -> _Plan | None:
        """Lay out frag[steps, envs]'s stacks as chains (module docstring), going on from the chains'
        ends where `go_on`; None if writing its new frames would overwrite the old ones it refers to."""
        (t0, t1), (n0, n1) = steps, envs
        T, N, K, W = t1 - t0, n1 - n0, self.stack, self.frames_written
        obs = frag.obs[t0:t1 + 1, n0:n1]
        final_t, final_n, final = self._finals(frag, steps, envs)
        D, n_obs = len(final), (T + 1) * N
        # Stacks: obs[t, n] is stack t * N + n, final d is n_obs + d. New frames each: 1 if it moves
        # the stack before it on by one frame, else K.
        moved_on = _shifted_stacks(obs[1:], obs[:-1], 2)
        new = np.full(n_obs + D, K, np.int64)
        if D:
            moved_on[final_t, final_n] = _shifted_stacks(obs[final_t + 1, final_n], final, 1)
            new[n_obs:] = np.where(_shifted_stacks(final, obs[final_t, final_n], 1), 1, K)
        new[N:n_obs] = np.where(moved_on.reshape(-1), 1, K)
        # Walk order: by env, then obs[0], final (if any) and obs[1] of step 0, and so on.
        env_of = np.concatenate([np.tile(np.arange(N), T + 1), final_n])
        when = np.concatenate([2 * np.repeat(np.arange(T + 1), N), 2 * final_t + 1])
        order = np.argsort(env_of * (2 * T + 2) + when)
        counts = new[order]
        ends = np.cumsum(counts)
        # Every stack is the last K frame numbers of its env's sequence (which starts with K of them).
        seq = np.empty(ends[-1], np.int64)
        fresh = np.ones(len(seq), bool)
        at = np.empty_like(order)
        at[order] = np.arange(len(order))
        cols, held = self._chain_starts(frag, obs[0], envs) if go_on else ([], [])
        if len(cols):
            slots = (ends[at[cols]] - K)[:, None] + np.arange(K)
            seq[slots] = held
            fresh[slots] = False
        new_frames = len(seq) - K * len(cols)
        oldest = min(W, int(held.min())) if len(cols) else W  # the oldest frame the part refers to
        if W + new_frames - self.num_frames > oldest:
            return None
        seq[fresh] = W + np.arange(new_frames)
        stacks = np.empty((len(order), K), np.int64)
        stacks[order] = seq[ends[:, None] - K + np.arange(K)]
        owner = np.repeat(np.arange(len(order)), counts)  # per sequence entry: its stack, in walk order
        frame_of = K - counts[owner] + np.arange(len(seq)) - (ends - counts)[owner]
        next_ids = np.arange(N, n_obs).reshape(T, N)
        next_ids[final_t, final_n] = n_obs + np.arange(D)
        return _Plan(new_frames, order[owner][fresh], frame_of[fresh], stacks[:T * N],
                     stacks[next_ids.reshape(-1)], stacks[T * N:n_obs], final)

    @staticmethod
    def _finals(frag: Fragment, steps: tuple[int, int], envs: tuple[int, int]):
        """(t, n) within frag[steps, envs] and final_obs of the episodes that ended there."""
        t, n = np.divmod(frag.final_index, frag.num_envs)
        inside = np.flatnonzero((t >= steps[0]) & (t < steps[1]) & (n >= envs[0]) & (n < envs[1]))
        return t[inside] - steps[0], n[inside] - envs[0], frag.final_obs[inside]

    def _chain_starts(self, frag: Fragment, first: np.ndarray, envs: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
        """The columns whose first stack `first[n]` goes on from their chain's end: its frames are
        held, written no more than `lag` frames ago, and equal to it. Returns (columns, [m, K] frames)."""
        cols, held = [], []
        for n in range(first.shape[0]):
            frames = self._chains.get((frag.actor_id, frag.incarnation, frag.env_ids[envs[0] + n]))
            if frames is not None and frames.min() >= self.frames_written - self.lag:
                cols.append(n)
                held.append(frames)
        if not cols:
            return np.empty(0, np.int64), np.empty((0, self.stack), np.int64)
        cols, held = np.array(cols), np.stack(held)
        same = _equal(self._frames[held % self.num_frames], first[cols], 1)
        return cols[same], held[same]

    def _commit(self, frag: Fragment, plan: _Plan, steps: tuple[int, int], envs: tuple[int, int]) -> None:
        (t0, t1), (n0, n1) = steps, envs
        N, F, C, W = n1 - n0, self.num_frames, self.capacity, self.frames_written
        rows = (t1 - t0) * N
        # Frames about to be overwritten: evict the transitions that refer to them, oldest first.
        evict = self._outdated(W + plan.new_frames - F)
        pushed_out = min(self.size, max(0, self.size + rows - C))  # what a ReplayRing would evict now
        self.evicted_early += max(0, evict - pushed_out)
        self.head, self.size = (self.head + evict) % C, self.size - evict
        # The new frames, in order from frame number W.
        pos = (W + np.arange(plan.new_frames)) % F
        obs, n_obs = frag.obs[t0:t1 + 1, n0:n1], (t1 - t0 + 1) * N
        from_obs = plan.stack_ids < n_obs
        t, n = np.divmod(plan.stack_ids[from_obs], N)
        self._frames[pos[from_obs]] = obs[t, n, plan.frame_of[from_obs]]
        if not from_obs.all():
            self._frames[pos[~from_obs]] = plan.final[plan.stack_ids[~from_obs] - n_obs, plan.frame_of[~from_obs]]
        self.frames_written = W + plan.new_frames
        # The transitions; a part larger than the ring keeps its newest, as ReplayRing does.
        fields, last = step_fields(frag, slice(t0, t1), slice(n0, n1), n_step=self.n_step, gamma=self.gamma)
        next_frames = plan.next_obs_frames if last is None else plan.next_obs_frames[last]
        keep = min(rows, C)
        low = np.minimum(plan.obs_frames.min(axis=1), next_frames.min(axis=1))[rows - keep:]
        floor = np.minimum.accumulate(low[::-1])[::-1]
        self._lower_floors(int(floor[0]))
        fields.update(obs_frames=plan.obs_frames, next_obs_frames=next_frames)
        at = (self.rows_written + np.arange(keep)) % C
        for name, values in fields.items():
            self._rows[name][at] = values[rows - keep:]
        self._floor[at] = floor
        self.rows_written += keep
        self.size += keep
        if self.size > C:
            self.head, self.size = (self.head + self.size - C) % C, C
        for n in range(N):
            key = (frag.actor_id, frag.incarnation, frag.env_ids[n0 + n])
            self._chains[key] = plan.chain_ends[n]
            self._chains.move_to_end(key)
        while len(self._chains) > MAX_CHAINS:
            self._chains.popitem(last=False)

    def _outdated(self, before: int) -> int:
        """How many of the oldest transitions must go for frames older than `before` to be overwritten."""
        return self._rows_below(before) if self.size and self._floor[self.head] < before else 0

    def _rows_below(self, value: int) -> int:
        """How many of the oldest rows have a floor below `value` (floors never decrease oldest to newest)."""
        floor, lo, hi = self._floor, 0, self.size
        while lo < hi:
            mid = (lo + hi) // 2
            if floor[(self.head + mid) % self.capacity] < value:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _lower_floors(self, floor: int) -> None:
        """Newer rows refer to frames from `floor` on: so do, from now on, all older ones."""
        higher = self._rows_below(floor + 1)  # rows from here to the newest have floors above `floor`
        if higher < self.size:
            start, stop = (self.head + higher) % self.capacity, (self.head + self.size) % self.capacity or self.capacity
            if start < stop:
                self._floor[start:stop] = floor
            else:
                self._floor[start:] = floor
                self._floor[:stop] = floor

    def gather(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Transitions by age (0 = the oldest held), their stacks rebuilt from the frame ring."""
        at = (self.head + rows) % self.capacity
        r, frames = self._rows, self._frames
        out = {"obs": frames[r["obs_frames"][at] % self.num_frames], "actions": r["actions"][at],
               "rewards": r["rewards"][at], "next_obs": frames[r["next_obs_frames"][at] % self.num_frames],
               "terminated": r["terminated"][at], "policy_version": r["policy_version"][at]}
        if "discount" in r:
            out["discount"] = r["discount"][at]
        return out

    def nbytes(self) -> int:
        return super().nbytes() + (self._floor.nbytes if self._floor is not None else 0)

    # --- checkpoints --------------------------------------------------------------------------------

    @property
    def data(self) -> dict[str, np.ndarray] | None:
        """"frames" (the frame ring) and the transition rows (ROW_FIELDS), None before the first insert.
        Live: read them, never write them."""
        return None if self._rows is None else {"frames": self._frames, **self._rows}

    def used(self) -> dict[str, int]:
        if self._rows is None:
            return {}
        rows = min(self.rows_written, self.capacity)
        return {"frames": min(self.frames_written, self.num_frames), **dict.fromkeys(self._rows, rows)}

    def mark(self) -> tuple[int, int]:
        return self.frames_written, self.rows_written

    def spans_since(self, mark: tuple[int, int]) -> Spans:
        """Frames and rows written after `mark`: at most two spans of each ring."""
        frames, rows = mark
        used = self.used()
        out = {"frames": ring_spans(frames % self.num_frames, self.frames_written - frames, self.num_frames,
                                    used["frames"])}
        row_spans = ring_spans(rows % self.capacity, self.rows_written - rows, self.capacity, used.get("rewards", 0))
        return out | dict.fromkeys(self._rows or (), row_spans)

    def state(self) -> dict:
        return {"kind": self.kind, "capacity": self.capacity, "frames": self.num_frames, "lag": self.lag,
                "size": self.size, "head": self.head, "rows_written": self.rows_written,
                "frames_written": self.frames_written, "rng": self._rng.bit_generator.state,
                **self.returns_state()}

    def restore(self, arrays: dict[str, np.ndarray], state: dict) -> None:
        """Take over a checkpoint (Replay.restore). Of a ring of the same capacity and frame ring, rows
        and frames stay where they were and sampling goes on exactly as it would have; otherwise the
        newest transitions that fit are kept, in order, with the frames they refer to (those whose
        frames a smaller frame ring cannot hold are counted in `evicted_early`). The chains' ends are
        not in a checkpoint: each env's next fragment starts its chain anew."""
        if state.get("kind") != self.kind:
            raise ValueError(f"it holds a {state.get('kind') or 'plain'!r} replay, not a compact one")
        names = ("capacity", "frames", "size", "head", "rows_written", "frames_written")
        capacity, frames, size, head, rows_written, written = (int(state[k]) for k in names)
        rng = np.random.default_rng()
        rng.bit_generator.state = state["rng"]  # raises ValueError/TypeError if it is not a PCG64 state
        self.check_returns(state)
        fields = ("obs_frames", "next_obs_frames", *self.row_fields)
        live, low = _check_restorable(arrays, capacity, frames, size, head, rows_written, written, fields)
        stack = arrays["obs_frames"].shape[1]
        num_frames, lag = self._geometry(stack)
        dropped = 0
        if (capacity, frames) == (self.capacity, num_frames):
            rows = {k: taken(arrays[k], capacity) for k in fields}
            frame_ring = taken(arrays["frames"], frames)
        else:
            keep, low = live[-self.capacity:], low[-self.capacity:]
            oldest = max(0, written - num_frames)  # the oldest frame the new ring holds
            below = np.flatnonzero(low < oldest)
            if len(below):
                dropped = int(below[-1]) + 1
                keep, low = keep[dropped:], low[dropped:]
            rows = {k: grown(arrays[k][keep], self.capacity) for k in fields}
            frame_ring = np.empty((num_frames, *arrays["frames"].shape[1:]), dtype=arrays["frames"].dtype)
            numbers = np.arange(max(oldest, written - frames), written)
            frame_ring[numbers % num_frames] = arrays["frames"][numbers % frames]
            head, size, rows_written = 0, len(keep), len(keep)
            live = np.arange(size)
        floor = np.empty(self.capacity, np.int64)
        floor[live] = np.minimum.accumulate(low[::-1])[::-1]
        self.stack, self.num_frames, self.lag = stack, num_frames, lag
        self._frames, self._rows, self._floor, self._rng = frame_ring, rows, floor, rng
        self._chains = OrderedDict()
        self.head, self.size, self.rows_written, self.frames_written = head, size, rows_written, written
        self.evicted_early += dropped


def _check_restorable(arrays: dict[str, np.ndarray], capacity: int, frames: int, size: int, head: int,
                      rows_written: int, written: int, fields: tuple[str, ...] = ROW_FIELDS
                      ) -> tuple[np.ndarray, np.ndarray]:
    """Raise ValueError unless the checkpoint describes a compact replay of row `fields`; returns its
    live rows, oldest first, and the oldest frame number each refers to."""
    if set(arrays) != {"frames", *fields}:
        raise ValueError(f"fields {sorted(arrays)} are not a compact replay's {sorted(['frames', *fields])}")
    if not (0 < size <= capacity and 0 <= head < capacity and size <= rows_written
            and (head + size - rows_written) % capacity == 0 and frames > 0 and written >= 0):
        raise ValueError(f"size {size}, oldest row {head}, {rows_written} rows and {written} frames written "
                         f"do not fit a ring of {capacity} rows and {frames} frames")
    for name in ("frames", *fields):
        expected = min(written, frames) if name == "frames" else min(rows_written, capacity)
        if arrays[name].ndim < 1 or len(arrays[name]) != expected:
            raise ValueError(f"{name}: {len(arrays[name]) if arrays[name].ndim else 'no'} rows, expected {expected}")
    obs, nxt = arrays["obs_frames"], arrays["next_obs_frames"]
    if obs.ndim != 2 or obs.shape != nxt.shape or obs.dtype != np.int64 or nxt.dtype != np.int64:
        raise ValueError(f"obs_frames {obs.dtype.name} {list(obs.shape)} and next_obs_frames {nxt.dtype.name} "
                         f"{list(nxt.shape)} must be int64 [rows, stack]")
    if obs.shape[1] < 1:
        raise ValueError("obs_frames: stacks of no frames")
    if any(arrays[k].ndim != 1 for k in ("rewards", "terminated", "policy_version")):
        raise ValueError("rewards, terminated and policy_version must hold one value per transition")
    live = (head + np.arange(size)) % capacity
    if live.max() >= len(obs):
        raise ValueError(f"live rows reach row {live.max()}, only {len(obs)} were written")
    low = np.minimum(obs[live].min(axis=1), nxt[live].min(axis=1))
    high = np.maximum(obs[live].max(axis=1), nxt[live].max(axis=1))
    if low.min() < max(0, written - frames) or high.max() >= written:
        raise ValueError(f"transitions refer to frames {low.min()}..{high.max()}, the ring holds "
                         f"{max(0, written - frames)}..{written - 1}")
    return live, low

"""What an actor refuses to record or act on: observations and rewards holding NaN or infinity, a
Discrete or MultiDiscrete observation outside 0..n-1 (always: it one-hot encodes to nothing), and, with
`actor.check_obs_bounds`, observations outside the finite bounds their space declares.

One NaN that reaches a fragment reaches the learner's weights, and one that reaches the policy's
input makes NaN actions (or ends the inference batch of every session). So a simulator's step that
holds one is refused before anything of it is recorded or acted on (sessions.py: its session ends
with INVALID_ARGUMENT, others go on), and a local env's ends the actor with a `BadEnvStep` naming the
env id and index (rollout.py), as SB3's VecCheckNan raises. Counted in
`actor/steps_refused_nonfinite_total` and `actor/steps_refused_out_of_bounds_total`.

Numpy only. A batch that is fine costs one `np.isfinite` pass (and one bounds comparison when they
are checked); the culprit is located only when something is wrong.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from services.common.protocol.spaces import DictLayout, dict_layout_from_proto
from services.common.stats import Metrics
from services.common.protocol.tensors import TensorError

NONFINITE_TOTAL = "actor/steps_refused_nonfinite_total"
OUT_OF_BOUNDS_TOTAL = "actor/steps_refused_out_of_bounds_total"


class BadEnvStep(ValueError):
    """A local env returned a step the actor must not record (NaN, infinity, or out of bounds)."""


@dataclass(frozen=True)
class Bad:
    """The first bad value found in a batch of per-env values."""
    field: str                  # "observations", "observations['pos']", "final_observations", "rewards"
    env: int                    # the env copy: its index in the session (or in the actor's vector env)
    element: tuple[int, ...]    # where in that env copy's value (or in its Dict key); () for a scalar
    value: float
    low: float = -math.inf      # the declared bounds the value is outside of (when it is finite)
    high: float = math.inf
    values: int = 0             # a categorical element's n, where the value is not one of 0..n-1
    who: str = ""               # how the row is named ("" = "env <env>"; a session of agents: the agent)

    @property
    def nonfinite(self) -> bool:
        return not math.isfinite(self.value)

    @property
    def metric(self) -> str:
        return NONFINITE_TOTAL if self.nonfinite else OUT_OF_BOUNDS_TOTAL

    def __str__(self) -> str:
        where = self.field + (f"[{', '.join(map(str, self.element))}]" if self.element else "")
        where += f" of {self.who or f'env {self.env}'}"
        if self.nonfinite:
            return f"{where} is {self.value} (NaN and infinity are refused)"
        if self.values:
            return (f"{where} is {self.value:g}, outside 0..{self.values - 1} (a categorical "
                    f"observation of {self.values} values)")
        return (f"{where} is {self.value:g}, outside its declared bounds "
                f"[{self.low:g}, {self.high:g}] (actor.check_obs_bounds)")


@dataclass(frozen=True, eq=False)
class Check:
    """How a batch [N, *shape] of per-env values is checked: always for NaN and infinity (floating
    point values); against `low`/`high` (arrays of one env copy's shape, +-inf where unbounded) when
    they are given. `layout`: a flattened Dict observation's keys, to name the key at fault. `nvec`: a
    Discrete or MultiDiscrete observation's n per element (an array of one env copy's shape), whose
    values must be integers in 0..n-1, always checked."""
    layout: DictLayout | None = None
    low: np.ndarray | None = None
    high: np.ndarray | None = None
    nvec: np.ndarray | None = None

    def find(self, values: np.ndarray, field: str = "observations", envs: Sequence[int] | None = None) -> Bad | None:
        """The first bad value of `values` (row k is env copy envs[k], or k), or None if all are good."""
        bad = None
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            bad = ~np.isfinite(values)
        elif self.low is not None:
            inside = (values >= self.low) & (values <= self.high)
            if not inside.all():
                bad = ~inside
        elif self.nvec is not None:
            inside = (values >= 0) & (values < self.nvec)
            if not inside.all():
                bad = ~inside
        if bad is None:
            return None
        row, *element = (int(i) for i in np.argwhere(bad)[0])
        value = float(values[(row, *element)])
        bounds = ({"values": int(self.nvec[tuple(element)])} if self.nvec is not None and math.isfinite(value)
                  else {} if self.low is None else {"low": float(self.low[tuple(element)]),
                                                    "high": float(self.high[tuple(element)])})
        env = row if envs is None else int(envs[row])
        if self.layout is not None and len(element) == 1:
            field, element = self._key_of(field, element[0])
        return Bad(field, env, tuple(element), value, **bounds)

    def _key_of(self, field: str, flat: int) -> tuple[str, tuple[int, ...]]:
        """`field['key']` and the index within that key of element `flat` of a flattened Dict."""
        for key, shape in self.layout:
            size = math.prod(shape)
            if flat < size:
                index = tuple(int(i) for i in np.unravel_index(flat, shape)) if size > 1 else ()
                return f"{field}[{key!r}]", index
            flat -= size
        raise AssertionError(f"element {flat} lies beyond the Dict layout")  # shapes were checked before

    @classmethod
    def of(cls, layout: DictLayout | None, low: np.ndarray | None, high: np.ndarray | None,
           dtype: np.dtype) -> Check:
        """A check with these bounds, dropping them where they can never fail: every bound infinite,
        or an integer dtype whose whole range lies within them (Atari's uint8 in [0, 255])."""
        if low is not None:
            low, high = np.asarray(low, np.float64), np.asarray(high, np.float64)
            lo, hi = ((np.iinfo(dtype).min, np.iinfo(dtype).max) if np.dtype(dtype).kind in "iu"
                      else (-math.inf, math.inf))
            if (low <= lo).all() and (high >= hi).all():
                low = high = None
        return cls(layout, low, high)

    @classmethod
    def from_hello(cls, space, obs_shape: tuple[int, ...], dtype: np.dtype, bounds: bool) -> Check:
        """The check of a session's observations from its hello's `observation_space` (a kuberl.v1.Space
        already found to fit the policy): a Dict's keys, and with `bounds` (actor.check_obs_bounds) the
        bounds its BoxSpaces declare. TensorError naming the field if those bounds are malformed."""
        kind = space.WhichOneof("kind")
        if kind == "box":
            low, high = (_declared(space.box, obs_shape, "observation_space.box") if bounds else (None, None))
            return cls.of(None, low, high, dtype)
        if kind in ("discrete", "multi_discrete"):
            return cls.categorical(getattr(space, kind))
        layout = dict_layout_from_proto(space.dict)
        if not bounds:
            return cls(layout)
        parts = [_declared(space.dict.spaces[k], shape, f"observation_space.dict.spaces[{k!r}]") for k, shape in layout]
        return cls.of(layout, np.concatenate([lo.reshape(-1) for lo, _ in parts]),
                      np.concatenate([hi.reshape(-1) for _, hi in parts]), dtype)

    @classmethod
    def from_gymnasium(cls, space, layout: DictLayout | None, bounds: bool) -> Check:
        """The check of a local env's observations: `space` is its (flattened) gymnasium Box, or its
        Discrete or MultiDiscrete space."""
        if type(space).__name__ in ("Discrete", "MultiDiscrete"):
            return cls.categorical(space)
        if not bounds:
            return cls(layout)
        return cls.of(layout, space.low, space.high, space.dtype)

    @classmethod
    def categorical(cls, space) -> Check:
        """The check of a Discrete or MultiDiscrete observation (a gymnasium space, or a kuberl.v1
        DiscreteSpace or MultiDiscreteSpace already found to fit the policy): its integers in 0..n-1."""
        return cls(nvec=np.asarray(list(space.nvec) if hasattr(space, "nvec") else space.n, np.int64))


FINITE = Check()  # NaN and infinity only: rewards, and observations when bounds are not checked


def _declared(box, shape: tuple[int, ...], field: str) -> tuple[np.ndarray, np.ndarray]:
    """The bounds a kuberl.v1.BoxSpace declares, as float64 arrays of `shape`: none (+-inf), one for
    every element, or one per element (row-major)."""
    size = math.prod(shape)
    out = []
    for name, values, default in (("low", box.low, -math.inf), ("high", box.high, math.inf)):
        if len(values) not in (0, 1, size):
            raise TensorError(f"{field}.{name}", f"has {len(values)} values: give 0, 1 or {size}")
        arr = np.asarray(values, np.float64) if values else np.full(1, default)
        out.append(np.broadcast_to(arr, (size,)).reshape(shape))
    low, high = out
    if np.isnan(low).any() or np.isnan(high).any() or (low > high).any():
        raise TensorError(field, "bounds must be numbers with low <= high")
    return low, high


def check_env_step(env_id: str, check: Check, metrics: Metrics, obs: np.ndarray, rewards: np.ndarray | None = None,
                   info: dict | None = None, ended: np.ndarray | None = None) -> None:
    """A local env's step (or, with only `obs`, its reset): raise BadEnvStep naming `env_id`, the field and
    the env index, counted, if its observations, rewards or (for the `ended` envs) `info["final_obs"]`
    hold a bad value."""
    done = [] if ended is None else np.flatnonzero(ended)
    bad = check.find(obs)
    if bad is None and rewards is not None:
        bad = FINITE.find(np.asarray(rewards), "rewards")
    if bad is None and len(done):
        bad = check.find(np.stack([np.asarray(info["final_obs"][i]) for i in done]), "info['final_obs']", done)
    if bad is not None:
        metrics.inc(bad.metric)
        raise BadEnvStep(f"env.id: {env_id} returned {bad}; the actor stops rather than record it "
                         f"(docs/reliability.md, non-finite data)")

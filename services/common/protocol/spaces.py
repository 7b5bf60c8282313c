"""Action spaces, from gymnasium and the wire to what actors, buffers and learners check.

Free of torch and gymnasium (the buffer and planner import it). An action space says how one step's
action is laid out in a fragment (`layout`), which values are valid (`check_actions`), how wide an
action mask is (`mask_width`), and how it is written in an EnvHello (`to_proto`, `from_proto`).
`EnvSpec` is an env's observation and action spaces together: what the networks are built for, and
what an algorithm checks it can train on (`Algorithm.check_spec`).

| space | one env's action | fragment `actions` | mask columns |
|---|---|---|---|
| Discrete(n) | int64 scalar in 0..n-1 | int64 [T, N] | n |
| MultiDiscrete(nvec) | int64 [k], choice i in 0..nvec[i]-1 | int64 [T, N, k] | sum(nvec) |
| Box(shape, low, high) | float32 [*shape] | float32 [T, N, *shape], unclipped | none |
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from services.common.protocol.tensors import NonFiniteError, TensorError, dtype_code, numpy_dtype

if TYPE_CHECKING:
    from kuberl.v1 import actor_pb2

MAX_CHOICES = 64       # MultiDiscrete: choices per action
MAX_ACTION_DIMS = 4    # Box actions: rank
MAX_ACTION_ELEMENTS = 4096


@dataclass(frozen=True)
class Discrete:
    n: int

    shape = ()
    dtype = np.dtype(np.int64)

    @property
    def mask_width(self) -> int:
        return self.n

    def __str__(self) -> str:
        return f"Discrete({self.n})"


@dataclass(frozen=True)
class MultiDiscrete:
    nvec: tuple[int, ...]

    dtype = np.dtype(np.int64)

    @property
    def shape(self) -> tuple[int, ...]:
        return (len(self.nvec),)

    @property
    def mask_width(self) -> int:
        return sum(self.nvec)

    def __str__(self) -> str:
        return f"MultiDiscrete({list(self.nvec)})"


@dataclass(frozen=True)
class Box:
    """A float32 action of `shape`; `low`/`high` hold one bound per element (row-major), +-inf where unbounded."""
    shape: tuple[int, ...]
    low: tuple[float, ...]
    high: tuple[float, ...]

    dtype = np.dtype(np.float32)
    mask_width = 0

    @classmethod
    def of(cls, shape: Iterable[int], low: npt.ArrayLike, high: npt.ArrayLike) -> Box:
        """A Box from array-likes (a scalar bound applies to every element); ValueError if malformed."""
        shape = tuple(int(d) for d in shape)
        size = int(np.prod(shape)) if shape else 1
        try:
            lo, hi = (np.broadcast_to(b.reshape(shape) if b.size == size else b, shape).reshape(-1)
                      for b in (np.asarray(x, np.float64) for x in (low, high)))
        except ValueError:
            raise ValueError(f"bounds must be one number or one per element of {list(shape)}") from None
        if np.isnan(lo).any() or np.isnan(hi).any() or (lo > hi).any():
            raise ValueError(f"bounds must be numbers with low <= high, one per element of {list(shape)}")
        return cls(shape, tuple(float(x) for x in lo), tuple(float(x) for x in hi))

    @property
    def low_array(self) -> np.ndarray:
        return np.asarray(self.low, np.float32).reshape(self.shape)

    @property
    def high_array(self) -> np.ndarray:
        return np.asarray(self.high, np.float32).reshape(self.shape)

    @property
    def bounded(self) -> bool:
        return all(math.isfinite(x) for x in self.low + self.high)

    def clip(self, actions: np.ndarray) -> np.ndarray:
        """`actions` [N, *shape] clipped to the bounds: what the env receives."""
        clipped: np.ndarray = np.clip(actions, self.low_array, self.high_array)
        return clipped

    def __str__(self) -> str:
        lo, hi = set(self.low), set(self.high)
        bounds = (f"[{lo.pop():g}, {hi.pop():g}]" if len(lo) == len(hi) == 1
                  else f"[{list(self.low)}, {list(self.high)}]")
        return f"Box({list(self.shape)}, {bounds})"


ActionSpace = Discrete | MultiDiscrete | Box


def random_actions(space: ActionSpace, n: int, mask: np.ndarray | None,
                   rng: np.random.Generator) -> np.ndarray:
    """`n` uniformly random actions: each choice uniform over what its row of `mask` allows ([n, mask
    width] bool; None: every action), a Box uniform within its bounds (`n` rows of the space's shape)."""
    if isinstance(space, Box):
        return rng.uniform(space.low_array, space.high_array, (n, *space.shape)).astype(np.float32)
    nvec = space.nvec if isinstance(space, MultiDiscrete) else (space.n,)
    out = np.empty((n, len(nvec)), np.int64)
    start = 0
    for i, width in enumerate(nvec):
        allowed = np.ones((n, width), bool) if mask is None else mask[:, start:start + width]
        # uniform over the allowed choices: the first allowed index past a uniform draw of their count
        counts = allowed.sum(axis=1)
        pick = (rng.random(n) * counts).astype(np.int64)
        out[:, i] = np.argmax(np.cumsum(allowed, axis=1) > pick[:, None], axis=1)
        start += width
    return out if isinstance(space, MultiDiscrete) else out[:, 0]


def check_actions(space: ActionSpace, actions: np.ndarray, lead: tuple[int, ...], field: str = "actions") -> None:
    """Raise TensorError naming `field` unless `actions` is `lead` + the space's shape, of its dtype,
    with every discrete value in range and every continuous one finite."""
    want = (*lead, *space.shape)
    if actions.shape != want or actions.dtype != space.dtype:
        raise TensorError(field, f"must be {space.dtype.name} {list(want)} for {space}, "
                                 f"got {actions.dtype.name} {list(actions.shape)}")
    if not actions.size:
        return
    if isinstance(space, Box):
        if not np.isfinite(actions).all():
            raise NonFiniteError(field, "holds NaN or infinity")
        return
    high = np.asarray(space.nvec if isinstance(space, MultiDiscrete) else space.n)
    if actions.min() < 0 or (actions >= high).any():
        raise TensorError(field, f"values must lie in 0..n-1 for {space}")


def check_mask(space: ActionSpace, mask: np.ndarray, lead: tuple[int, ...], field: str = "action_mask") -> None:
    """Raise TensorError naming `field` unless `mask` is bool `lead` + [mask width] allowing at least
    one action (of every choice) everywhere."""
    width = space.mask_width
    if not width or isinstance(space, Box):   # (a Box's mask_width is 0)
        raise TensorError(field, f"{space} takes no action mask")
    want = (*lead, width)
    if mask.shape != want or mask.dtype != np.bool_:
        raise TensorError(field, f"must be bool {list(want)} for {space}, got {mask.dtype.name} {list(mask.shape)}")
    nvec = space.nvec if isinstance(space, MultiDiscrete) else (space.n,)
    for i, part in enumerate(np.split(mask, np.cumsum(nvec)[:-1], axis=-1)):
        if part.size and not part.any(axis=-1).all():
            what = "choice %d" % i if len(nvec) > 1 else "the action"
            raise TensorError(field, f"allows no value of {what} somewhere: at least one must be allowed")


def from_gymnasium(space: Any) -> ActionSpace:
    """The action space of a gymnasium env; ValueError naming env.id's action space otherwise."""
    kind = type(space).__name__
    if kind == "Discrete":
        if int(space.start) != 0:
            raise ValueError(f"env action space: Discrete with start {space.start} (only 0 is supported)")
        return Discrete(int(space.n))
    if kind == "MultiDiscrete":
        nvec = np.asarray(space.nvec)
        if nvec.ndim != 1 or (np.asarray(space.start) != 0).any():
            raise ValueError(f"env action space: {space} (only 1-d MultiDiscrete starting at 0 is supported)")
        return checked(MultiDiscrete(tuple(int(n) for n in nvec)))
    if kind == "Box":
        if not np.issubdtype(space.dtype, np.floating):
            raise ValueError(f"env action space: {space} (a Box action must be floating point)")
        return checked(Box.of(space.shape, space.low, space.high))
    raise ValueError(f"env action space: {space} is not Discrete, MultiDiscrete or Box")


def checked(space: ActionSpace) -> ActionSpace:
    if isinstance(space, MultiDiscrete) and not (1 <= len(space.nvec) <= MAX_CHOICES and min(space.nvec) >= 1):
        raise ValueError(f"{space}: 1..{MAX_CHOICES} choices, each of at least 1 value")
    if isinstance(space, Box) and not (1 <= len(space.shape) <= MAX_ACTION_DIMS and min(space.shape) >= 1
                                       and np.prod(space.shape) <= MAX_ACTION_ELEMENTS):
        raise ValueError(f"{space}: rank 1..{MAX_ACTION_DIMS}, every dim >= 1, at most {MAX_ACTION_ELEMENTS} elements")
    return space


def to_proto(space: ActionSpace, msg: actor_pb2.Space) -> None:
    """Write `space` into a kuberl.v1.Space message."""
    if isinstance(space, Discrete):
        msg.discrete.n = space.n
    elif isinstance(space, MultiDiscrete):
        msg.multi_discrete.nvec.extend(space.nvec)
    else:
        msg.box.shape.extend(space.shape)
        msg.box.dtype = dtype_code(space.dtype)
        msg.box.low.extend(space.low)
        msg.box.high.extend(space.high)


def from_proto(msg: actor_pb2.Space, field: str = "action_space") -> ActionSpace:
    """The action space a kuberl.v1.Space declares; TensorError naming `field` if it is not one."""
    kind = msg.WhichOneof("kind")
    try:
        if kind == "discrete":
            if msg.discrete.n < 1:
                raise ValueError(f"n = {msg.discrete.n} must be >= 1")
            return Discrete(int(msg.discrete.n))
        if kind == "multi_discrete":
            return checked(MultiDiscrete(tuple(int(n) for n in msg.multi_discrete.nvec)))
        if kind == "box":
            box = msg.box
            if numpy_dtype(box.dtype, f"{field}.box.dtype") != np.float32:
                raise ValueError("a Box action must be DTYPE_FLOAT32")
            shape = tuple(box.shape)
            size = int(np.prod(shape)) if shape else 1
            bounds: list[float | list[float]] = []
            for name, values, default in (("low", box.low, -math.inf), ("high", box.high, math.inf)):
                if len(values) not in (0, 1, size):
                    raise ValueError(f"{name} has {len(values)} values: give 0, 1 or {size}")
                bounds.append(default if not values else values[0] if len(values) == 1 else list(values))
            return checked(Box.of(shape, *bounds))
    except ValueError as err:
        raise TensorError(field, f"{kind}: {err}") from None
    raise TensorError(field, f"{kind or 'nothing'} is not an action space (Discrete, MultiDiscrete or Box)")


# -- Dict observations -------------------------------------------------------------------------------
# A Dict of Boxes is flattened into one float32 vector: the keys in sorted order, each Box row-major
# (gymnasium's flatten). Its layout, ((key, shape), ...) in that order, is what must agree between a
# simulator and the policy; the element dtypes need not (everything becomes float32).
MAX_KEYS = 64
MAX_KEY_LEN = 64

DictLayout = tuple[tuple[str, tuple[int, ...]], ...]


def dict_layout(shapes: Mapping[str, Iterable[int]]) -> DictLayout:
    """The layout of a Dict observation given each key's shape; ValueError if it cannot be one."""
    if not 0 < len(shapes) <= MAX_KEYS:
        raise ValueError(f"a Dict observation has 1..{MAX_KEYS} keys, got {len(shapes)}")
    out = []
    for key in sorted(shapes):
        shape = tuple(int(d) for d in shapes[key])
        if not 0 < len(key) <= MAX_KEY_LEN:
            raise ValueError(f"key {key[:MAX_KEY_LEN]!r}: keys have 1..{MAX_KEY_LEN} characters")
        if len(shape) > 8 or any(d < 1 for d in shape):
            raise ValueError(f"key {key!r}: shape {list(shape)} must have rank <= 8 and every dim >= 1")
        out.append((key, shape))
    return tuple(out)


def flat_size(layout: DictLayout) -> int:
    return int(sum(np.prod(shape, dtype=np.int64) for _, shape in layout))


def describe(layout: DictLayout) -> str:
    return "Dict(" + ", ".join(f"{k}: {list(s)}" for k, s in layout) + ")"


def dict_layout_from_proto(msg: actor_pb2.DictSpace, field: str = "observation_space") -> DictLayout:
    """The layout a kuberl.v1.DictSpace declares; TensorError naming `field` if malformed."""
    try:
        for key, box in msg.spaces.items():
            numpy_dtype(box.dtype, f"{field}.dict.spaces[{key[:MAX_KEY_LEN]!r}].dtype")
        return dict_layout({key: tuple(box.shape) for key, box in msg.spaces.items()})
    except ValueError as err:
        raise TensorError(field, f"dict: {err}") from None


def dict_layout_to_proto(layout: DictLayout, msg: actor_pb2.DictSpace, dtype: npt.DTypeLike = np.float32) -> None:
    """Write `layout` into a kuberl.v1.DictSpace message (every Box of `dtype`)."""
    for key, shape in layout:
        msg.spaces[key].shape.extend(shape)
        msg.spaces[key].dtype = dtype_code(np.dtype(dtype))


def flatten_dict(values: Mapping[str, npt.ArrayLike], layout: DictLayout, lead: tuple[int, ...] = ()) -> np.ndarray:
    """`values` (key -> array of `lead` + that key's shape) as one float32 array of `lead` + [flat size]."""
    if set(values) != {k for k, _ in layout}:
        raise ValueError(f"observation keys {sorted(values)} differ from the declared {[k for k, _ in layout]}")
    parts = []
    for key, shape in layout:
        arr = np.asarray(values[key])
        if arr.shape != (*lead, *shape):
            raise ValueError(f"observation[{key!r}]: shape {list(arr.shape)}, expected {[*lead, *shape]}")
        parts.append(arr.reshape(*lead, -1).astype(np.float32, copy=False))
    return np.concatenate(parts, axis=-1)


@dataclass(frozen=True)
class EnvSpec:
    """What the networks need to know about an environment: from a gymnasium env (services/common/envs.py)
    or declared in the config (`EnvConfig.declared_spec`)."""
    obs_shape: tuple[int, ...]
    obs_dtype: np.dtype
    action: ActionSpace
    # A Dict observation flattened into obs_shape = (flat size,) float32: its layout ((key, shape), ...
    # keys sorted); None for a Box observation.
    obs_keys: DictLayout | None = None

    @property
    def num_actions(self) -> int:
        """n of a Discrete action space (ValueError for any other: say what the caller needs)."""
        if not isinstance(self.action, Discrete):
            raise ValueError(f"this needs a Discrete action space, not {self.action}")
        return self.action.n

"""Action spaces, from gymnasium and the wire to what actors, buffers and learners check.

Free of torch and gymnasium (the buffer and planner import it). An action space says how one step's
action is laid out in a fragment (`layout`), which values are valid (`check_actions`), how wide an
action mask is (`mask_width`), and how it is written in an EnvHello (`to_proto`, `from_proto`).
`EnvSpec` is an env's observation and action spaces together: what the networks are built for, and
what an algorithm checks it can train on (`Algorithm.check_spec`).

Observations are a Box, a Discrete or MultiDiscrete (the integers themselves travel: SB3's one-hot
encoding is the network's first step, services/common/models/nets.py `OneHot`), or a Dict of those
flattened into one float32 vector:

| observation | one env's, on the wire and in buffers | one-hot columns the network reads |
|---|---|---|
| Box(shape, dtype) | dtype [*shape] | none (the values themselves) |
| Discrete(n) | int64 scalar in 0..n-1 | n |
| MultiDiscrete(nvec) | int64 [k], element i in 0..nvec[i]-1 | sum(nvec) |
| Dict of those | float32 [flat size]: keys sorted, a Box row-major, a Discrete as its index | those of its keys |

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
# simulator and the policy; the element dtypes need not (everything becomes float32). A Discrete key
# (shape []) or MultiDiscrete key (shape [k]) holds its integers as float32 values, not one-hot as
# gymnasium's flatten would: the spec's `obs_categories` say which values they are (below).
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


# -- Discrete observations ---------------------------------------------------------------------------
# A Discrete(n) observation travels as one int64 per env (obs_shape ()), a MultiDiscrete(nvec) one as
# int64 [k], a Dict's Discrete or MultiDiscrete key as its integers among the flat float32 values. So
# fragments and replay buffers hold the integers, not n floats each; the network's first step one-hots
# them. Which flat elements are integers, and of how many values each, is the spec's `obs_categories`.
Categories = tuple[tuple[int, int], ...]   # (flat index, n) of each categorical element, ascending
MAX_OBS_ONE_HOT = 1 << 16   # one-hot columns of an observation: the sum of n over its categorical elements


def observation_space(space: Any, what: str = "observation space") -> Discrete | MultiDiscrete:
    """The Discrete or MultiDiscrete observation space of a gymnasium (or this module's) space;
    ValueError naming `what` if it cannot be one (a start other than 0, a MultiDiscrete of rank > 1)."""
    kind = type(space).__name__
    if kind == "Discrete":
        if int(getattr(space, "start", 0)) != 0 or int(space.n) < 1:
            raise ValueError(f"{what}: {space} (a Discrete observation must start at 0 and have n >= 1)")
        out: Discrete | MultiDiscrete = Discrete(int(space.n))
    elif kind == "MultiDiscrete":
        nvec = np.asarray(space.nvec)
        if nvec.ndim != 1 or not nvec.size or (np.asarray(getattr(space, "start", 0)) != 0).any() or nvec.min() < 1:
            raise ValueError(f"{what}: {space} (a MultiDiscrete observation must be 1-d, start at 0 and have "
                             f"every nvec >= 1)")
        out = MultiDiscrete(tuple(int(n) for n in nvec))
    else:
        raise ValueError(f"{what}: {space} is not Discrete or MultiDiscrete")
    width = out.n if isinstance(out, Discrete) else sum(out.nvec)
    if width > MAX_OBS_ONE_HOT:
        raise ValueError(f"{what}: {out} one-hots into {width} columns, more than {MAX_OBS_ONE_HOT}")
    return out


def categories_of(space: Discrete | MultiDiscrete, offset: int = 0) -> Categories:
    """The categorical elements of `space`'s values placed at flat index `offset`."""
    nvec = (space.n,) if isinstance(space, Discrete) else space.nvec
    return tuple((offset + i, n) for i, n in enumerate(nvec))


def discrete_spec(space: Discrete | MultiDiscrete, action: ActionSpace) -> EnvSpec:
    """The spec of a Discrete or MultiDiscrete observation (int64 [] or [k] per env) and `action`."""
    return EnvSpec(space.shape, np.dtype(np.int64), action, None, categories_of(space))


def dict_categories(layout: DictLayout, discrete: Mapping[str, Discrete | MultiDiscrete]) -> Categories:
    """The categorical elements of a flattened Dict of `layout` whose keys `discrete` are Discrete or
    MultiDiscrete (the others Boxes); ValueError if they one-hot into too many columns."""
    out: list[tuple[int, int]] = []
    offset = 0
    for key, shape in layout:
        if key in discrete:
            out.extend(categories_of(discrete[key], offset))
        offset += math.prod(shape)
    if sum(n for _, n in out) > MAX_OBS_ONE_HOT:
        raise ValueError(f"the Discrete keys of {describe(layout)} one-hot into more than {MAX_OBS_ONE_HOT} columns")
    return tuple(out)


def describe_observation(spec: EnvSpec) -> str:
    """The observation space of `spec` in words, for messages: Box[4] float32, Discrete(16), Dict(...)."""
    if spec.obs_keys is not None:
        kinds = _key_spaces(spec)
        return "Dict(" + ", ".join(f"{k}: {kinds.get(k) or list(s)}" for k, s in spec.obs_keys) + ")"
    discrete = spec.discrete_obs
    return str(discrete) if discrete is not None else f"Box{list(spec.obs_shape)} {spec.obs_dtype.name}"


def _key_spaces(spec: EnvSpec) -> dict[str, str]:
    """The Discrete or MultiDiscrete keys of a Dict spec, described."""
    assert spec.obs_keys is not None
    n_of = dict(spec.obs_categories)
    out, offset = {}, 0
    for key, shape in spec.obs_keys:
        size = math.prod(shape)
        if offset in n_of:
            nvec = [n_of[offset + i] for i in range(size)]
            out[key] = f"Discrete({nvec[0]})" if shape == () else f"MultiDiscrete({nvec})"
        offset += size
    return out


def check_observations(spec: EnvSpec, obs: np.ndarray, field: str = "observations") -> None:
    """Raise TensorError naming `field` (and the Dict key) unless every categorical element of `obs`
    (any leading dims, then the spec's obs_shape) is an integer in 0..n-1: what one-hot encodes. A
    value outside is bad data, as NaN is for a Box; the network never sees it. No-op for a Box."""
    if not spec.obs_categories or not obs.size:
        return
    flat = obs.reshape(-1, math.prod(spec.obs_shape))
    index = np.fromiter((i for i, _ in spec.obs_categories), np.int64, len(spec.obs_categories))
    high = np.fromiter((n for _, n in spec.obs_categories), np.int64, len(spec.obs_categories))
    values = flat[:, index]
    bad = ~((values >= 0) & (values < high))
    if values.dtype.kind == "f":
        bad |= values != np.floor(values)
    if not bad.any():
        return
    row, col = (int(i) for i in np.argwhere(bad)[0])
    where, element = field, int(index[col])
    if spec.obs_keys is not None:
        for key, shape in spec.obs_keys:
            size = math.prod(shape)
            if element < size:
                where = f"{field}[{key!r}]" + (f"[{element}]" if shape else "")
                break
            element -= size
    elif spec.obs_shape:
        where = f"{field}[{element}]"
    rows = "" if obs.ndim == len(spec.obs_shape) else f" (row {row})"
    raise TensorError(where, f"is {values[row, col]:g}{rows}, outside 0..{high[col] - 1} (a categorical "
                             f"observation of {high[col]} values)")


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
    # The categorical elements of the (flat) observation, which the networks one-hot: (flat index, n)
    # each, ascending (`obs_categories`); () for Box observations.
    obs_categories: Categories = ()

    @property
    def discrete_obs(self) -> Discrete | MultiDiscrete | None:
        """The Discrete or MultiDiscrete space the whole observation is (None: a Box or a Dict)."""
        if self.obs_keys is not None or not self.obs_categories:
            return None
        if self.obs_shape == ():
            return Discrete(self.obs_categories[0][1])
        return MultiDiscrete(tuple(n for _, n in self.obs_categories))

    @property
    def num_actions(self) -> int:
        """n of a Discrete action space (ValueError for any other: say what the caller needs)."""
        if not isinstance(self.action, Discrete):
            raise ValueError(f"this needs a Discrete action space, not {self.action}")
        return self.action.n


def spec_to_dict(spec: EnvSpec) -> dict[str, Any]:
    """`spec` as plain values (lists, numbers, strings; unbounded Box bounds as +-inf): what a learner
    checkpoint keeps of the spaces its policy was built for, so the policy is rebuilt from the
    checkpoint alone (services/cli/trained.py), without its env. `spec_from_dict` reads it back."""
    a = spec.action
    action: dict[str, Any] = ({"discrete": a.n} if isinstance(a, Discrete)
                              else {"multi_discrete": list(a.nvec)} if isinstance(a, MultiDiscrete)
                              else {"box": {"shape": list(a.shape), "low": list(a.low), "high": list(a.high)}})
    return {"observation_shape": list(spec.obs_shape), "observation_dtype": spec.obs_dtype.name, "action": action,
            "observation_keys": None if spec.obs_keys is None else [[k, list(s)] for k, s in spec.obs_keys],
            "observation_categories": [[i, n] for i, n in spec.obs_categories]}


def spec_from_dict(d: Mapping[str, Any]) -> EnvSpec:
    """The EnvSpec `spec_to_dict` wrote; ValueError saying what is malformed."""
    try:
        action = d["action"]
        if "discrete" in action:
            space: ActionSpace = Discrete(int(action["discrete"]))
        elif "multi_discrete" in action:
            space = checked(MultiDiscrete(tuple(int(n) for n in action["multi_discrete"])))
        else:
            box = action["box"]
            space = checked(Box.of(box["shape"], box["low"], box["high"]))
        keys = d.get("observation_keys")
        categories = tuple((int(i), int(n)) for i, n in d.get("observation_categories") or ())
        return EnvSpec(tuple(int(n) for n in d["observation_shape"]), np.dtype(d["observation_dtype"]), space,
                       None if keys is None else dict_layout({k: s for k, s in keys}), categories)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"not the spaces of a policy ({type(err).__name__}: {err})") from None

"""The trajectory-fragment layout: built by actors, validated and decoded by buffers and learners.

A fragment holds T steps of N envs, time-major (see TrajectoryFragment in common.proto). This module
is the only place that knows which tensor goes where; `decode_fragment` checks every invariant the
proto documents and raises TensorError naming the field, before any data is stored.
"""

from __future__ import annotations

import ctypes
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np

from kuberl.v1 import common_pb2 as pb
from services.common.protocol import wire
from services.common.protocol.tensors import (DEFAULT_MAX_ELEMENTS, NonFiniteError, TensorError, TensorLike, check_finite,
                                     decode, encode, encode_parts)

MAX_STEPS = 65536
MAX_ID_LEN = 128
# Seqs per (actor_id, incarnation) a buffer dedupes exactly (services/buffer/store.py SeqWindow). A
# sender must never have more fragments unacknowledged, so config keeps actor.queue_fragments below it.
DEDUPE_WINDOW = 65536
# The tensors of a TransitionBatch (common.proto), in declaration order.
TRANSITION_FIELDS = ("obs", "actions", "rewards", "next_obs", "terminated", "policy_version")


@dataclass(frozen=True)
class Fragment:
    """A validated fragment as read-only numpy views. Shapes as in TrajectoryFragment."""

    actor_id: str
    seq: int
    policy_version: int
    incarnation: int
    algorithm: int
    env_ids: tuple[int, ...]
    obs: np.ndarray                # [T+1, N, *obs_shape]
    actions: np.ndarray            # [T, N, *action_shape]
    rewards: np.ndarray            # [T, N] float32
    terminated: np.ndarray         # [T, N] bool
    truncated: np.ndarray          # [T, N] bool
    final_obs: np.ndarray          # [K, *obs_shape]
    final_index: np.ndarray        # [K] int64, flat t * N + n
    action_mask: np.ndarray | None = None  # [T, N, M] bool: the actions allowed at obs[t]; None: all
    # The algorithm's float32 tensors by name (services/algorithms/base.py, `Extras`): per step
    # [T, N, ...], or per env at the fragment's first step [N, ...] (a recurrent core's state).
    extras: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_steps(self) -> int:
        return int(self.rewards.shape[0])

    @property
    def num_envs(self) -> int:
        return int(self.rewards.shape[1])

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


_FRAGMENT_FIELDS = {f.number: f for f in pb.TrajectoryFragment.DESCRIPTOR.fields}
_FIELD_NUMBERS = {f.name: f.number for f in pb.TrajectoryFragment.DESCRIPTOR.fields}
_TENSOR_FIELDS = {f.number: f.name for f in pb.Tensor.DESCRIPTOR.fields}
_TENSOR_NAMES = frozenset(f.name for f in pb.TrajectoryFragment.DESCRIPTOR.fields
                          if f.message_type is pb.Tensor.DESCRIPTOR)
_EXTRAS = _FIELD_NUMBERS["extras"]
MAX_EXTRAS = 16             # extras a fragment may carry
MAX_EXTRA_NAME = 64         # characters of an extra's name


class RawTensor:
    """A Tensor read off the wire: `data` is a memoryview of the received bytes (no copy)."""
    __slots__ = ("dtype", "shape", "data")
    dtype: int
    shape: list[int]
    data: memoryview

    def __init__(self, buf: memoryview):
        self.dtype, self.shape, self.data = 0, [], memoryview(b"")
        for number, wire_type, value in wire.fields(buf):
            name = _TENSOR_FIELDS.get(number)
            # (wire.fields gives a VARINT's value as an int, a LEN's as a memoryview: isinstance only narrows)
            if name == "dtype" and wire_type == wire.VARINT and isinstance(value, int):
                self.dtype = value
            elif name == "shape":
                self.shape.extend(wire.as_int64(v) for v in wire.packed_varints(value, wire_type))
            elif name == "data" and wire_type == wire.LEN and isinstance(value, memoryview):
                self.data = value
            elif name is not None:
                raise wire.WireError(f"Tensor.{name} has wire type {wire_type}")


class RawFragment:
    """A TrajectoryFragment read from its serialized bytes without copying the tensor payloads.

    Quacks like the generated message as far as `decode_fragment` and the buffer need (the scalar
    fields, `env_ids`, `HasField`, the tensors as RawTensor) and keeps `data`, the bytes it came
    from, to be forwarded as they are. Construction never raises: a malformed message is recorded
    in `error` (with whatever was read before it, e.g. `seq`) and raised by `decode_fragment`.
    """

    def __init__(self, data: bytes):
        self.data = data
        self.actor_id, self.seq, self.policy_version, self.algorithm, self.num_steps = "", 0, 0, 0, 0
        self.incarnation = 0
        self.created_unix_s = 0.0
        self.env_ids: list[int] = []
        self._tensors: dict[str, RawTensor] = {}
        self.extras: dict[str, RawTensor] = {}
        self.error: str | None = None
        try:
            self._read(memoryview(data))
        except (wire.WireError, UnicodeDecodeError) as err:
            self.error = f"malformed TrajectoryFragment: {err}"

    def _read(self, buf: memoryview) -> None:
        for number, wire_type, value in wire.fields(buf):
            fd = _FRAGMENT_FIELDS.get(number)
            if fd is None:
                continue  # an unknown (newer) field: skipped, as protobuf does
            name = fd.name
            # (wire.fields gives a LEN's value as a memoryview, the others' as an int: isinstance only narrows)
            if number == _EXTRAS:
                if wire_type != wire.LEN or not isinstance(value, memoryview):
                    raise wire.WireError(f"extras has wire type {wire_type}")
                self._read_extra(value)
            elif name in _TENSOR_NAMES:
                if wire_type != wire.LEN or not isinstance(value, memoryview):
                    raise wire.WireError(f"{name} has wire type {wire_type}")
                if name in self._tensors:  # never written by a protobuf encoder; refused, not merged
                    raise wire.WireError(f"{name} appears twice")
                self._tensors[name] = RawTensor(value)
            elif name == "env_ids":
                self.env_ids.extend(wire.packed_varints(value, wire_type))
            elif name == "actor_id" and wire_type == wire.LEN and isinstance(value, memoryview):
                self.actor_id = str(value, "utf-8")
            elif name == "created_unix_s" and wire_type == wire.FIXED64 and isinstance(value, int):
                self.created_unix_s = float(np.frombuffer(value.to_bytes(8, "little"), "<f8")[0])
            elif wire_type == wire.VARINT and name in ("seq", "policy_version", "algorithm", "num_steps",
                                                                "incarnation"):
                setattr(self, name, value)
            else:
                raise wire.WireError(f"{name} has wire type {wire_type}")

    def _read_extra(self, buf: memoryview) -> None:
        """One entry of the `extras` map: key (1) and value (2)."""
        key, value = "", None
        for number, wire_type, v in wire.fields(buf):
            if number == 1 and wire_type == wire.LEN and isinstance(v, memoryview):
                key = str(v, "utf-8")
            elif number == 2 and wire_type == wire.LEN and isinstance(v, memoryview):
                value = RawTensor(v)
            else:
                raise wire.WireError(f"an extras entry has field {number} of wire type {wire_type}")
        if key in self.extras:  # never written by a protobuf encoder; refused, not merged
            raise wire.WireError(f"extras.{key} appears twice")
        self.extras[key] = value if value is not None else RawTensor(memoryview(b""))

    def HasField(self, name: str) -> bool:  # noqa: N802 (the generated messages' name)
        return name in self._tensors

    def __getattr__(self, name: str) -> RawTensor:
        if name in _TENSOR_NAMES:  # an absent tensor reads as empty, as on a generated message
            return self._tensors.get(name) or RawTensor(memoryview(b""))
        raise AttributeError(name)

    def to_message(self) -> pb.TrajectoryFragment:
        """The generated message (a parse: copies the payload)."""
        return pb.TrajectoryFragment.FromString(self.data)


def new_incarnation() -> int:
    """A process's incarnation (TrajectoryFragment.incarnation): random, 64-bit, never 0.

    Chosen once per process, so a process restarted under the same actor id (a pod's container
    restart, `kuberl up` restarting actor-3) starts a new dedupe sequence instead of having its
    fragments taken for re-sends of its predecessor's."""
    return secrets.randbits(64) or 1


def build_fragment(*, actor_id: str, seq: int, policy_version: int, algorithm: pb.Algorithm, env_ids: Iterable[int],
                   obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, terminated: np.ndarray,
                   truncated: np.ndarray, final_obs: np.ndarray, final_index: np.ndarray,
                   extras: Mapping[str, np.ndarray] | None = None, action_mask: np.ndarray | None = None,
                   incarnation: int = 0) -> pb.TrajectoryFragment:
    """Encode one fragment (arrays shaped as in TrajectoryFragment) into its wire message."""
    msg = pb.TrajectoryFragment(actor_id=actor_id, seq=seq, policy_version=policy_version, incarnation=incarnation,
                                algorithm=algorithm, env_ids=list(env_ids),
                                num_steps=rewards.shape[0], created_unix_s=time.time())
    encode(obs, msg.obs)
    encode(actions, msg.actions)
    encode(rewards.astype(np.float32, copy=False), msg.rewards)
    encode(terminated.astype(bool, copy=False), msg.terminated)
    encode(truncated.astype(bool, copy=False), msg.truncated)
    encode(final_obs, msg.final_obs)
    encode(final_index.astype(np.int64, copy=False), msg.final_index)
    if action_mask is not None:
        encode(action_mask.astype(bool, copy=False), msg.action_mask)
    for name, arr in sorted((extras or {}).items()):
        encode(arr.astype(np.float32, copy=False), msg.extras[name])
    return msg


@dataclass(frozen=True)
class EncodedFragment:
    """A serialized TrajectoryFragment with the header fields a sender needs to track it."""
    seq: int
    samples: int   # T * N
    payload: bytes
    policy: str = ""   # the policy whose table it goes to, of several in a run ("": the only one)

    @classmethod
    def of(cls, msg: pb.TrajectoryFragment) -> EncodedFragment:
        return cls(msg.seq, msg.num_steps * len(msg.env_ids), msg.SerializeToString())


def encode_fragment(*, actor_id: str, seq: int, policy_version: int, algorithm: pb.Algorithm, env_ids: Iterable[int],
                    obs: np.ndarray, actions: np.ndarray, rewards: np.ndarray, terminated: np.ndarray,
                    truncated: np.ndarray, final_obs: np.ndarray, final_index: np.ndarray,
                    extras: Mapping[str, np.ndarray] | None = None, action_mask: np.ndarray | None = None,
                    created_unix_s: float | None = None, incarnation: int = 0,
                    release_gil: bool = False) -> EncodedFragment:
    """`build_fragment(...).SerializeToString()`, byte for byte, with the tensor data copied once.

    Building the message copies each array into it and serializing copies it again; this writes the
    wire format directly and joins the arrays' own memory into the payload in one copy (the actor
    calls it in its rollout thread, so the event loop only writes bytes).
    `release_gil`: make that copy with the GIL released (`join_releasing_gil`), for a thread that
    encodes beside an event loop; the same bytes.
    """
    head = pb.TrajectoryFragment(actor_id=actor_id, seq=seq, policy_version=policy_version, algorithm=algorithm,
                                 env_ids=list(env_ids), num_steps=rewards.shape[0],
                                 incarnation=incarnation).SerializeToString()
    parts: list[bytes | memoryview] = [head]
    tensors = [("obs", obs), ("actions", actions), ("rewards", rewards.astype(np.float32, copy=False)),
               ("terminated", terminated.astype(bool, copy=False)), ("truncated", truncated.astype(bool, copy=False)),
               ("final_obs", final_obs), ("final_index", final_index.astype(np.int64, copy=False))]
    if action_mask is not None:
        tensors.append(("action_mask", action_mask.astype(bool, copy=False)))
    for name, arr in tensors:  # in field-number order, as the protobuf runtime writes them
        t_head, data = encode_parts(arr)
        parts += [wire.len_prefix(_FIELD_NUMBERS[name], len(t_head) + len(data)), t_head, data]
    for name, arr in sorted((extras or {}).items()):   # map entries: key (1), value (2)
        key = name.encode()
        t_head, data = encode_parts(arr.astype(np.float32, copy=False))
        entry = len(wire.len_prefix(1, len(key))) + len(key) + len(wire.len_prefix(2, len(t_head) + len(data)))
        parts += [wire.len_prefix(_EXTRAS, entry + len(t_head) + len(data)), wire.len_prefix(1, len(key)), key,
                  wire.len_prefix(2, len(t_head) + len(data)), t_head, data]
    parts.append(pb.TrajectoryFragment(
        created_unix_s=time.time() if created_unix_s is None else created_unix_s).SerializeToString())
    return EncodedFragment(seq, int(rewards.size), join_releasing_gil(parts) if release_gil else b"".join(parts))


GIL_FREE_MIN_BYTES = 256 * 1024
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)


def join_releasing_gil(parts: Iterable[bytes | memoryview]) -> bytes:
    """`b"".join(parts)` (C-contiguous buffers), with the copy made while the GIL is released.

    bytes.join holds the GIL through its copy whenever a part is not `bytes` (the arrays' memoryviews
    are not), so a thread joining a 15 MB fragment stalls the event loop for the whole copy. Here the
    result is created uninitialized, as the C API does (PyBytes_FromStringAndSize(NULL, n)), and filled
    by numpy, which copies large blocks without the GIL, before anything else can see it.
    """
    views = [memoryview(p).cast("B") for p in parts]
    total = sum(len(v) for v in views)
    if total < GIL_FREE_MIN_BYTES:  # too short a copy to stall the loop: the plain join is quicker
        return b"".join(views)
    out: bytes = _new_bytes(None, total)
    if total:
        address = np.frombuffer(out, np.uint8).ctypes.data
        dst = np.ctypeslib.as_array((ctypes.c_uint8 * total).from_address(address))  # writable: ours alone
        offset = 0
        for v in views:
            if n := len(v):
                dst[offset:offset + n] = np.frombuffer(v, np.uint8)
                offset += n
    return out


def _expect(cond: bool, field: str, message: str | Callable[[], str]) -> None:
    """Raise TensorError(field, message) unless `cond`; `message` may be a callable, formatted only
    on failure (the checks run for every fragment a buffer receives)."""
    if not cond:
        raise TensorError(field, message() if callable(message) else message)


def algorithm_name(code: int) -> str:
    """A kuberl.v1.Algorithm code's name as configs write it (`ppo` for ALGORITHM_PPO), for messages;
    the number itself when the protocol has no such code."""
    try:
        return pb.Algorithm.Name(code).removeprefix("ALGORITHM_").lower()
    except ValueError:
        return str(code)


def decode_fragment(msg: pb.TrajectoryFragment | RawFragment, *, algorithm: int | None = None,
                    extras: tuple[str, ...] | None = None, start_extras: tuple[str, ...] = (),
                    max_elements: int = DEFAULT_MAX_ELEMENTS) -> Fragment:
    """Validate a TrajectoryFragment and return it decoded (zero-copy views of its bytes).

    `algorithm`, when given, is the only algorithm accepted, and `extras` the names of the per-step
    extras its fragments carry ([T, N, ...]), `start_extras` those of the extras given once per env
    at the first step ([N, ...]): the receiving algorithm's `Extras`. Each is required and no other
    is taken. `extras` None requires none and checks whichever are present (per step unless named in
    `start_extras`). Raises TensorError naming the field (`extras.<name>` for an extra).
    `msg` may be a RawFragment (the zero-copy read of the serialized bytes); its arrays are then
    views of those bytes.
    """
    if isinstance(msg, RawFragment) and msg.error is not None:
        raise TensorError("fragment", msg.error)
    _expect(0 < len(msg.actor_id) <= MAX_ID_LEN, "actor_id", lambda: f"must be 1..{MAX_ID_LEN} characters")
    _expect(msg.algorithm in pb.Algorithm.values() and msg.algorithm != pb.ALGORITHM_UNSPECIFIED, "algorithm",
            lambda: f"unknown or unspecified algorithm {msg.algorithm}")
    if algorithm is not None and msg.algorithm != algorithm:
        raise TensorError("algorithm", f"fragment is for {algorithm_name(msg.algorithm)} but this receiver serves "
                                       f"{algorithm_name(algorithm)}")
    T, N = msg.num_steps, len(msg.env_ids)
    _expect(0 < T <= MAX_STEPS, "num_steps", lambda: f"{T} is outside 1..{MAX_STEPS}")
    _expect(N > 0, "env_ids", "must name at least one env")

    def get(name: str) -> np.ndarray:
        """A required tensor, decoded."""
        _expect(msg.HasField(name), name, "is required but missing")
        return decode(getattr(msg, name), name, max_elements)

    obs = get("obs")
    _expect(obs.ndim >= 2 and obs.shape[:2] == (T + 1, N), "obs.shape",
            lambda: f"must start with [T+1={T + 1}, N={N}], got {list(obs.shape)}")
    actions = get("actions")
    _expect(actions.ndim >= 2 and actions.shape[:2] == (T, N), "actions.shape",
            lambda: f"must start with [T={T}, N={N}], got {list(actions.shape)}")
    step_fields: dict[str, np.ndarray] = {}
    for name, dtype in (("rewards", np.float32), ("terminated", np.bool_), ("truncated", np.bool_)):
        arr = get(name)
        _expect(arr.shape == (T, N), f"{name}.shape", lambda: f"must be [T={T}, N={N}], got {list(arr.shape)}")
        _expect(arr.dtype == dtype, f"{name}.dtype", lambda: f"must be {np.dtype(dtype).name}, got {arr.dtype.name}")
        step_fields[name] = arr
    if not np.isfinite(step_fields["rewards"]).all():
        raise NonFiniteError("rewards", "holds NaN or infinity")

    final_index = get("final_index")
    _expect(final_index.ndim == 1 and final_index.dtype == np.int64, "final_index",
            lambda: f"must be a 1-d int64 tensor, got {final_index.dtype.name} {list(final_index.shape)}")
    done = np.flatnonzero((step_fields["terminated"] | step_fields["truncated"]).reshape(-1))
    _expect(np.array_equal(np.sort(final_index), done), "final_index",
            lambda: f"must list each of the {len(done)} steps that ended an episode exactly once")
    final_obs = get("final_obs")
    _expect(final_obs.shape == (len(final_index), *obs.shape[2:]) and final_obs.dtype == obs.dtype,
            "final_obs", lambda: f"must be {obs.dtype.name} [K={len(final_index)}, *obs_shape={list(obs.shape[2:])}], "
                         f"got {final_obs.dtype.name} {list(final_obs.shape)}")

    given: dict[str, TensorLike] = dict(msg.extras)
    _expect(len(given) <= MAX_EXTRAS, "extras", lambda: f"{len(given)} extras, at most {MAX_EXTRAS}")
    takes = None if extras is None else (*extras, *start_extras)
    for name in takes or start_extras:
        _expect(name in given, f"extras.{name}", "is required but missing")
    decoded: dict[str, np.ndarray] = {}
    for name, tensor in sorted(given.items()):
        _expect(0 < len(name) <= MAX_EXTRA_NAME, "extras", lambda: f"names are 1..{MAX_EXTRA_NAME} characters")
        _expect(takes is None or name in takes, f"extras.{name}",
                lambda: f"is not a field of {algorithm_name(msg.algorithm)} fragments "
                        f"(it takes {', '.join(takes or ()) or 'no extras'})")
        arr = decode(tensor, f"extras.{name}", max_elements)
        if name in start_extras:   # one value per env, at the first step
            _expect(arr.ndim >= 1 and arr.shape[0] == N and arr.dtype == np.float32, f"extras.{name}",
                    lambda: f"must be float32 [N={N}, ...], got {arr.dtype.name} {list(arr.shape)}")
        else:
            _expect(arr.ndim >= 2 and arr.shape[:2] == (T, N) and arr.dtype == np.float32, f"extras.{name}",
                    lambda: f"must be float32 [T={T}, N={N}, ...], got {arr.dtype.name} {list(arr.shape)}")
        decoded[name] = arr
    mask = decode(msg.action_mask, "action_mask", max_elements) if msg.HasField("action_mask") else None
    if mask is not None:
        _expect(mask.ndim == 3 and mask.shape[:2] == (T, N) and mask.dtype == np.bool_, "action_mask",
                lambda: f"must be bool [T={T}, N={N}, M], got {mask.dtype.name} {list(mask.shape)}")
    # Bad data is bad input: refused here, where it arrives, rather than stored to poison every batch
    # that samples it (a learner would skip those whole, services/algorithms/checks.py).
    check_finite({"obs": obs, "final_obs": final_obs, "actions": actions,
                  **{f"extras.{name}": arr for name, arr in decoded.items()}})
    return Fragment(actor_id=msg.actor_id, seq=msg.seq, policy_version=msg.policy_version,
                    incarnation=msg.incarnation, algorithm=msg.algorithm, env_ids=tuple(msg.env_ids), obs=obs, actions=actions,
                    final_obs=final_obs, final_index=final_index, action_mask=mask, extras=decoded,
                    **step_fields)


def batch_samples(batch: pb.TrainingBatch) -> int:
    """Samples in a TrainingBatch as its wire header says (transitions, or steps of all fragments)."""
    if batch.HasField("transitions"):
        shape = batch.transitions.rewards.shape
        return int(shape[0]) if len(shape) else 0
    return sum(f.num_steps * len(f.env_ids) for f in batch.rollouts.fragments)

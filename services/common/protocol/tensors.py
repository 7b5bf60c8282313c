"""The one module that knows the Tensor wire encoding: dtype + shape + raw little-endian bytes.

Decoding validates everything before touching the data (dtype whitelist, rank, non-negative dims,
element limit, exact byte length) and raises TensorError naming the field, so a servicer can
answer INVALID_ARGUMENT with a useful message. Decoded arrays are zero-copy, read-only views of the
message bytes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Protocol, cast

import numpy as np

from kuberl.v1 import common_pb2 as pb
from services.common.protocol import wire

MAX_RANK = 8
_DATA_FIELD = pb.Tensor.DESCRIPTOR.fields_by_name["data"].number
DEFAULT_MAX_ELEMENTS = 256 * 1024 * 1024

_TO_NUMPY: dict[int, np.dtype] = {
    pb.DTYPE_UINT8: np.dtype("<u1"),
    pb.DTYPE_INT8: np.dtype("<i1"),
    pb.DTYPE_INT16: np.dtype("<i2"),
    pb.DTYPE_INT32: np.dtype("<i4"),
    pb.DTYPE_INT64: np.dtype("<i8"),
    pb.DTYPE_FLOAT16: np.dtype("<f2"),
    pb.DTYPE_FLOAT32: np.dtype("<f4"),
    pb.DTYPE_FLOAT64: np.dtype("<f8"),
    pb.DTYPE_BOOL: np.dtype("?"),
}
# Keyed by (kind, itemsize) so that either byte order of a numpy dtype maps to its wire code.
_FROM_NUMPY: dict[tuple[str, int], pb.DType] = {(dt.kind, dt.itemsize): cast(pb.DType, code)
                                                for code, dt in _TO_NUMPY.items()}


class TensorLike(Protocol):
    """What `decode` reads: a Tensor message, or a RawTensor read off the wire (services/common/protocol/fragments.py)."""

    @property
    def dtype(self) -> int: ...

    @property
    def shape(self) -> Iterable[int]: ...

    @property
    def data(self) -> bytes | memoryview: ...


class TensorError(ValueError):
    """A tensor (or a message built of tensors) failed validation. `field` names the culprit."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class NonFiniteError(TensorError):
    """A tensor holding NaN or infinity where only finite values may be: such data must never reach a
    learner's weights (a learner counts it apart from malformed data)."""


def check_finite(arrays: dict[str, np.ndarray | None]) -> None:
    """Raise NonFiniteError naming the first field (name -> array; None: absent) whose floating-point
    values are not all finite."""
    for name, arr in arrays.items():
        if arr is not None and arr.dtype.kind == "f" and not np.isfinite(arr).all():
            bad = int(arr.size - np.isfinite(arr).sum())
            raise NonFiniteError(name, f"{bad} of its {arr.size} values are NaN or infinite")


def dtype_code(dtype: np.dtype) -> pb.DType:
    """Wire code of a numpy dtype; raises TensorError for dtypes outside the whitelist."""
    dt = np.dtype(dtype)
    try:
        return _FROM_NUMPY[(dt.kind, dt.itemsize)]
    except KeyError:
        raise TensorError("dtype", f"numpy dtype {np.dtype(dtype)} has no wire encoding") from None


def numpy_dtype(code: int, field: str = "dtype") -> np.dtype:
    """Numpy dtype of a wire code; raises TensorError naming `field` for unknown codes."""
    try:
        return _TO_NUMPY[code]
    except KeyError:
        what = "is unspecified" if code == pb.DTYPE_UNSPECIFIED else f"code {code} is unknown"
        raise TensorError(field, f"dtype {what}") from None


def encode(array: np.ndarray, out: pb.Tensor | None = None) -> pb.Tensor:
    """Encode an array (any layout; copied to C order, little-endian) into a Tensor message."""
    arr = np.asarray(array)
    code = dtype_code(arr.dtype)
    wire = _TO_NUMPY[code]
    if arr.dtype != wire:
        arr = arr.astype(wire)
    msg = out if out is not None else pb.Tensor()
    msg.dtype = code
    msg.shape[:] = arr.shape
    msg.data = np.ascontiguousarray(arr).tobytes()
    return msg


def encode_parts(array: np.ndarray) -> tuple[bytes, memoryview]:
    """The serialized Tensor of `array` in two parts: the header (dtype, shape and the key and length
    of `data`) and the element bytes as a memoryview of the array itself (no copy when the array
    is already C-ordered little-endian). `header + data` is byte for byte what `encode(array)`
    serializes to; callers join the parts of many tensors with a single copy."""
    arr = np.asarray(array)
    code = dtype_code(arr.dtype)
    wire_dtype = _TO_NUMPY[code]
    arr = np.ascontiguousarray(arr if arr.dtype == wire_dtype else arr.astype(wire_dtype))
    head = pb.Tensor(dtype=code, shape=arr.shape).SerializeToString()
    # numpy's stubs give ndarray `__buffer__` for Python >= 3.12 only; it is a buffer on 3.11 too.
    data = memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    if len(data):  # proto3 leaves an empty `data` out
        head += wire.len_prefix(_DATA_FIELD, len(data))
    return head, data


def check_shape(shape: Iterable[int], field: str, max_elements: int = DEFAULT_MAX_ELEMENTS) -> tuple[int, ...]:
    """Validate a wire shape (rank, non-negative dims, element limit) and return it as a tuple."""
    dims = tuple(int(d) for d in shape)
    if len(dims) > MAX_RANK:
        raise TensorError(field, f"rank {len(dims)} exceeds the limit of {MAX_RANK}")
    for i, d in enumerate(dims):
        if d < 0:
            raise TensorError(field, f"dimension {i} is negative ({d})")
    n = math.prod(dims)
    if n > max_elements:
        raise TensorError(field, f"{n} elements exceed the limit of {max_elements}")
    return dims


def decode(msg: TensorLike, field: str, max_elements: int = DEFAULT_MAX_ELEMENTS) -> np.ndarray:
    """Validate a Tensor and return a read-only, zero-copy numpy view of its data.

    Raises TensorError naming `field` for an unknown dtype, a bad shape, or a byte length that
    does not match the shape.
    """
    dt = numpy_dtype(msg.dtype, f"{field}.dtype")
    dims = check_shape(msg.shape, f"{field}.shape", max_elements)
    expected = math.prod(dims) * dt.itemsize
    if len(msg.data) != expected:
        raise TensorError(f"{field}.data", f"has {len(msg.data)} bytes but shape {list(dims)} of "
                                           f"{dt.name} needs {expected}")
    arr = np.frombuffer(msg.data, dtype=dt).reshape(dims)
    if dt == np.dtype("?") and arr.size and arr.view(np.uint8).max() > 1:
        raise TensorError(f"{field}.data", "bool tensor holds a byte other than 0 or 1")
    return arr

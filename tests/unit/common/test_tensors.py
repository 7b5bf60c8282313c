"""services/common/protocol/tensors.py: the Tensor wire encoding and its validation."""

from __future__ import annotations

import numpy as np
import pytest

from kuberl.v1 import common_pb2 as pb
from services.common.protocol.tensors import MAX_RANK, TensorError, decode, dtype_code, encode, numpy_dtype

DTYPES = [
    (np.uint8, pb.DTYPE_UINT8),
    (np.int8, pb.DTYPE_INT8),
    (np.int16, pb.DTYPE_INT16),
    (np.int32, pb.DTYPE_INT32),
    (np.int64, pb.DTYPE_INT64),
    (np.float16, pb.DTYPE_FLOAT16),
    (np.float32, pb.DTYPE_FLOAT32),
    (np.float64, pb.DTYPE_FLOAT64),
    (np.bool_, pb.DTYPE_BOOL),
]


def sample(dtype, shape=(2, 3)) -> np.ndarray:
    n = int(np.prod(shape))
    if np.dtype(dtype) == np.bool_:
        return (np.arange(n) % 3 == 0).reshape(shape)
    values = np.arange(n) - n // 2  # includes negatives for the signed types
    if np.dtype(dtype).kind == "u":
        values = np.arange(n) * 7
    elif np.dtype(dtype).kind == "f":
        values = values * 0.5
    return values.astype(dtype).reshape(shape)


def tensor(dtype: int, shape, data: bytes) -> pb.Tensor:
    return pb.Tensor(dtype=dtype, shape=shape, data=data)


@pytest.mark.parametrize("dtype,code", DTYPES)
def test_round_trip_every_whitelisted_dtype(dtype, code):
    arr = sample(dtype)
    msg = encode(arr)
    assert msg.dtype == code
    assert list(msg.shape) == [2, 3]
    out = decode(msg, "x")
    assert out.dtype == np.dtype(dtype).newbyteorder("<")
    assert out.shape == (2, 3)
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("dtype,code", [d for d in DTYPES if np.dtype(d[0]).itemsize > 1])
def test_big_endian_input_is_written_little_endian(dtype, code):
    arr = sample(dtype).astype(np.dtype(dtype).newbyteorder(">"))
    msg = encode(arr)
    assert msg.dtype == code
    assert msg.data == sample(dtype).astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    out = decode(msg, "x")
    assert out.dtype == np.dtype(dtype).newbyteorder("<")
    np.testing.assert_array_equal(out, arr)


def test_wire_bytes_are_little_endian_row_major():
    msg = encode(np.array([[1, 2], [3, 4]], dtype=">i2"))
    assert msg.data == bytes([1, 0, 2, 0, 3, 0, 4, 0])


def test_scalar_round_trip():
    msg = encode(np.float64(2.5))
    assert list(msg.shape) == []
    assert len(msg.data) == 8
    out = decode(msg, "x")
    assert out.shape == ()
    assert out.dtype == np.float64
    assert out[()] == 2.5


@pytest.mark.parametrize("shape", [(0,), (3, 0, 2), (0, 0)])
def test_zero_size_dims_round_trip(shape):
    msg = encode(np.zeros(shape, np.float32))
    assert list(msg.shape) == list(shape)
    assert msg.data == b""
    out = decode(msg, "x")
    assert out.shape == shape
    assert out.dtype == np.float32


@pytest.mark.parametrize("view", [
    lambda a: a[:, ::2],
    lambda a: a.T,
    lambda a: a[::-1, 1:],
])
def test_non_contiguous_input_round_trips(view):
    arr = view(np.arange(24, dtype=np.int32).reshape(4, 6))
    assert not arr.flags.c_contiguous
    out = decode(encode(arr), "x")
    assert out.shape == arr.shape
    np.testing.assert_array_equal(out, arr)


def test_encode_into_existing_message_replaces_its_contents():
    msg = encode(np.zeros((5, 5), np.float64))
    same = encode(np.array([7, 8], np.int8), out=msg)
    assert same is msg
    assert msg.dtype == pb.DTYPE_INT8
    assert list(msg.shape) == [2]
    np.testing.assert_array_equal(decode(msg, "x"), [7, 8])


def test_decoded_array_is_read_only_view():
    out = decode(encode(np.arange(6, dtype=np.float32)), "x")
    assert out.flags.writeable is False
    assert out.flags.owndata is False
    with pytest.raises(ValueError, match="read-only"):
        out[0] = 1.0


@pytest.mark.parametrize("dtype,code", DTYPES)
def test_dtype_code_and_numpy_dtype_are_inverse(dtype, code):
    assert dtype_code(np.dtype(dtype)) == code
    assert numpy_dtype(code) == np.dtype(dtype).newbyteorder("<")
    assert dtype_code(np.dtype(dtype).newbyteorder(">")) == code


@pytest.mark.parametrize("dtype", [np.complex64, object, np.uint16, np.uint64, "U4", "datetime64[s]"])
def test_dtype_code_rejects_unsupported_numpy_dtypes(dtype):
    with pytest.raises(TensorError, match="has no wire encoding") as e:
        dtype_code(np.dtype(dtype))
    assert e.value.field == "dtype"


def test_encode_rejects_unsupported_dtype():
    with pytest.raises(TensorError, match="complex64"):
        encode(np.zeros(3, np.complex64))


def test_tensor_error_is_a_value_error_with_field_prefix():
    err = TensorError("obs.shape", "bad")
    assert isinstance(err, ValueError)
    assert err.field == "obs.shape"
    assert str(err) == "obs.shape: bad"


# --- rejections ---------------------------------------------------------------------------------

@pytest.mark.parametrize("code,match", [
    (42, "code 42 is unknown"),
    (pb.DTYPE_UNSPECIFIED, "unspecified"),
])
def test_decode_rejects_bad_dtype_code(code, match):
    with pytest.raises(TensorError, match=match) as e:
        decode(tensor(code, [1], b"\x00"), "obs")
    assert e.value.field == "obs.dtype"


def test_decode_rejects_negative_dim():
    with pytest.raises(TensorError, match=r"dimension 1 is negative \(-2\)") as e:
        decode(tensor(pb.DTYPE_UINT8, [3, -2], b""), "obs")
    assert e.value.field == "obs.shape"


def test_decode_rejects_two_negative_dims_whose_product_is_positive():
    with pytest.raises(TensorError, match="dimension 0 is negative") as e:
        decode(tensor(pb.DTYPE_UINT8, [-2, -3], b"\x00" * 6), "obs")
    assert e.value.field == "obs.shape"


def test_decode_accepts_rank_limit_and_rejects_rank_above_it():
    assert decode(tensor(pb.DTYPE_UINT8, [1] * MAX_RANK, b"\x05"), "obs").ndim == MAX_RANK
    with pytest.raises(TensorError, match=f"rank {MAX_RANK + 1} exceeds the limit of {MAX_RANK}") as e:
        decode(tensor(pb.DTYPE_UINT8, [1] * (MAX_RANK + 1), b"\x05"), "obs")
    assert e.value.field == "obs.shape"


def test_decode_enforces_max_elements():
    assert decode(tensor(pb.DTYPE_UINT8, [10], bytes(10)), "obs", max_elements=10).shape == (10,)
    with pytest.raises(TensorError, match="11 elements exceed the limit of 10") as e:
        decode(tensor(pb.DTYPE_UINT8, [11], bytes(11)), "obs", max_elements=10)
    assert e.value.field == "obs.shape"


def test_decode_rejects_huge_shape_before_reading_data():
    with pytest.raises(TensorError, match="elements exceed the limit") as e:
        decode(tensor(pb.DTYPE_FLOAT32, [1 << 40, 1 << 40], b""), "obs")
    assert e.value.field == "obs.shape"


@pytest.mark.parametrize("nbytes", [7, 9, 0])
def test_decode_rejects_wrong_byte_length(nbytes):
    with pytest.raises(TensorError, match=rf"has {nbytes} bytes but shape \[2\] of int32 needs 8") as e:
        decode(tensor(pb.DTYPE_INT32, [2], bytes(nbytes)), "rewards")
    assert e.value.field == "rewards.data"


def test_decode_rejects_wrong_byte_length_for_scalar():
    with pytest.raises(TensorError, match="needs 4") as e:
        decode(tensor(pb.DTYPE_FLOAT32, [], b""), "x")
    assert e.value.field == "x.data"


def test_decode_rejects_bool_byte_other_than_zero_or_one():
    with pytest.raises(TensorError, match="bool tensor holds a byte other than 0 or 1") as e:
        decode(tensor(pb.DTYPE_BOOL, [3], bytes([0, 2, 1])), "terminated")
    assert e.value.field == "terminated.data"


def test_decode_accepts_bool_bytes_zero_and_one():
    out = decode(tensor(pb.DTYPE_BOOL, [3], bytes([0, 1, 1])), "terminated")
    np.testing.assert_array_equal(out, [False, True, True])

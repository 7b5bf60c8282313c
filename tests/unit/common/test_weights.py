"""services/common/protocol/weights.py: chunked, checksummed weights encoding and reassembly."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kuberl.v1 import common_pb2 as pb
from services.common.protocol.tensors import TensorError
from services.common.protocol.weights import WeightsAssembler, encode_weights


def named_tensors() -> dict[str, np.ndarray]:
    return {
        "q.0.weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 3,
        "q.0.bias": np.linspace(-1, 1, 5),                       # float64
        "steps": np.array([[1, -2], [3, 1 << 40]], np.int64),
        "mask": np.array([True, False, True, True, False, False, True]),
        "half": np.array([0.5, -2.0, 65504.0], np.float16),
        "big_endian": np.array([1.5, -3.25], ">f4"),
    }


def total_bytes(tensors) -> int:
    return sum(a.nbytes for a in tensors.values())


def assemble(chunks, assembler=None):
    assembler = assembler or WeightsAssembler()
    results = [assembler.add(c) for c in chunks]
    assert all(r is None for r in results[:-1])
    return results[-1]


def test_round_trip_over_many_chunks():
    tensors = named_tensors()
    size = total_bytes(tensors)
    chunks = encode_weights(9, tensors, chunk_bytes=10)
    assert len(chunks) == math.ceil(size / 10) > 5
    assert [c.chunk_index for c in chunks] == list(range(len(chunks)))
    assert all(c.num_chunks == len(chunks) for c in chunks)
    assert all(c.version == 9 and c.total_bytes == size for c in chunks)
    assert len({c.checksum for c in chunks}) == 1
    assert all(len(c.data) <= 10 for c in chunks)
    assert sum(len(c.data) for c in chunks) == size
    assert [s.name for s in chunks[0].specs] == list(tensors)
    assert all(len(c.specs) == 0 for c in chunks[1:])

    version, arrays = assemble(chunks)
    assert version == 9
    assert list(arrays) == list(tensors)
    for name, arr in tensors.items():
        assert arrays[name].shape == arr.shape, name
        assert arrays[name].dtype == arr.dtype.newbyteorder("<"), name
        np.testing.assert_array_equal(arrays[name], arr, err_msg=name)


def test_specs_describe_offsets_in_payload_order():
    tensors = named_tensors()
    specs = encode_weights(1, tensors, chunk_bytes=1 << 20)[0].specs
    offsets = np.cumsum([0] + [a.nbytes for a in tensors.values()])[:-1]
    assert [s.offset for s in specs] == list(offsets)
    assert [list(s.shape) for s in specs] == [list(a.shape) for a in tensors.values()]


def test_single_chunk_when_payload_fits():
    chunks = encode_weights(1, named_tensors())
    assert len(chunks) == 1
    assert chunks[0].num_chunks == 1


def test_exact_multiple_of_chunk_size_has_no_empty_trailing_chunk():
    chunks = encode_weights(1, {"w": np.zeros(8, np.float32)}, chunk_bytes=16)
    assert [len(c.data) for c in chunks] == [16, 16]


@pytest.mark.parametrize("tensors", [{}, {"empty": np.zeros((0, 3), np.float32)}])
def test_empty_payload_still_yields_one_chunk(tensors):
    chunks = encode_weights(4, tensors, chunk_bytes=8)
    assert len(chunks) == 1
    assert chunks[0].num_chunks == 1 and chunks[0].total_bytes == 0 and chunks[0].data == b""
    version, arrays = WeightsAssembler().add(chunks[0])
    assert version == 4
    assert list(arrays) == list(tensors)
    for name, arr in tensors.items():
        assert arrays[name].shape == arr.shape


def test_assembled_arrays_are_read_only():
    _, arrays = assemble(encode_weights(1, named_tensors(), chunk_bytes=16))
    assert all(a.flags.writeable is False for a in arrays.values())


def test_scalar_tensor_keeps_its_shape():
    chunks = encode_weights(1, {"num_batches_tracked": np.array(7, np.int64)})
    assert list(chunks[0].specs[0].shape) == []
    _, arrays = WeightsAssembler().add(chunks[0])
    assert arrays["num_batches_tracked"].shape == ()


def test_consecutive_versions_on_one_assembler():
    assembler = WeightsAssembler()
    for version in (1, 2, 3):
        tensors = {"w": np.full(6, version, np.float32)}
        got_version, arrays = assemble(encode_weights(version, tensors, chunk_bytes=8), assembler)
        assert got_version == version
        np.testing.assert_array_equal(arrays["w"], tensors["w"])


def test_out_of_order_chunk_raises_and_assembler_recovers_on_next_chunk_zero():
    chunks = encode_weights(3, named_tensors(), chunk_bytes=10)
    assembler = WeightsAssembler()
    assert assembler.add(chunks[0]) is None
    with pytest.raises(TensorError, match="chunk 2 of version 3 arrived out of order") as e:
        assembler.add(chunks[2])
    assert e.value.field == "weights.chunk_index"
    # The partial version was dropped: continuing with chunk 1 is out of order too.
    with pytest.raises(TensorError, match="out of order"):
        assembler.add(chunks[1])
    version, arrays = assemble(chunks, assembler)
    assert version == 3
    np.testing.assert_array_equal(arrays["steps"], named_tensors()["steps"])


def test_stream_starting_mid_version_raises():
    chunks = encode_weights(3, named_tensors(), chunk_bytes=10)
    with pytest.raises(TensorError, match="chunk 1 of version 3") as e:
        WeightsAssembler().add(chunks[1])
    assert e.value.field == "weights.chunk_index"


def test_chunk_of_another_version_mid_stream_raises():
    old = encode_weights(3, named_tensors(), chunk_bytes=10)
    new = encode_weights(4, named_tensors(), chunk_bytes=10)
    assembler = WeightsAssembler()
    assembler.add(old[0])
    with pytest.raises(TensorError, match="chunk 1 of version 4"):
        assembler.add(new[1])


def test_new_chunk_zero_restarts_assembly():
    old = encode_weights(3, named_tensors(), chunk_bytes=10)
    new = encode_weights(4, named_tensors(), chunk_bytes=10)
    assembler = WeightsAssembler()
    assembler.add(old[0])
    assembler.add(old[1])
    version, _ = assemble(new, assembler)
    assert version == 4


def test_corrupted_chunk_fails_checksum_and_assembler_recovers():
    chunks = encode_weights(5, named_tensors(), chunk_bytes=10)
    bad = pb.Weights()
    bad.CopyFrom(chunks[1])
    data = bytearray(bad.data)
    data[3] ^= 0xFF
    bad.data = bytes(data)
    assembler = WeightsAssembler()
    with pytest.raises(TensorError, match="version 5 failed its checksum") as e:
        assemble([chunks[0], bad, *chunks[2:]], assembler)
    assert e.value.field == "weights.checksum"
    assert assemble(chunks, assembler)[0] == 5


def test_truncated_chunk_fails_checksum():
    chunks = encode_weights(5, named_tensors(), chunk_bytes=10)
    chunks[-1].data = chunks[-1].data[:-1]
    with pytest.raises(TensorError) as e:
        assemble(chunks)
    assert e.value.field == "weights.checksum"


def test_spec_offset_past_payload_raises():
    tensors = {"a": np.zeros(4, np.float32), "b": np.ones(2, np.float64)}
    chunks = encode_weights(1, tensors, chunk_bytes=8)
    chunks[0].specs[1].offset = chunks[0].total_bytes - 8 + 1  # last byte of b would be past the end
    with pytest.raises(TensorError, match="extends past the end of the payload") as e:
        assemble(chunks)
    assert e.value.field == "weights.specs[b]"


def test_spec_with_unknown_dtype_raises():
    chunks = encode_weights(1, {"a": np.zeros(4, np.float32)})
    chunks[0].specs[0].dtype = 42
    with pytest.raises(TensorError, match="code 42 is unknown") as e:
        assemble(chunks)
    assert e.value.field == "weights.specs[a].dtype"


def test_spec_with_negative_dim_raises():
    chunks = encode_weights(1, {"a": np.zeros(4, np.float32)})
    chunks[0].specs[0].shape[:] = [-4]
    with pytest.raises(TensorError, match="negative") as e:
        assemble(chunks)
    assert e.value.field == "weights.specs[a].shape"


def test_encode_rejects_unsupported_dtype():
    with pytest.raises(TensorError, match="no wire encoding"):
        encode_weights(1, {"c": np.zeros(2, np.complex64)})


def test_take_then_assemble_is_add_split_in_two():
    """The actor takes chunks on its event loop and assembles (join, hash, split) in a thread."""
    tensors = named_tensors()
    chunks = encode_weights(4, tensors, chunk_bytes=16)
    assembler = WeightsAssembler()
    assert [assembler.take(c) for c in chunks] == [False] * (len(chunks) - 1) + [True]
    version, arrays = assembler.assemble()
    assert version == 4 and list(arrays) == list(tensors)
    np.testing.assert_array_equal(arrays["steps"], tensors["steps"])
    with pytest.raises(TensorError, match="no complete version"):
        assembler.assemble()            # it was handed out: nothing is left to assemble
    assert assemble(encode_weights(5, tensors, chunk_bytes=16), assembler)[0] == 5

    partial = WeightsAssembler()
    assert partial.take(chunks[0]) is False
    with pytest.raises(TensorError, match="no complete version"):
        partial.assemble()

"""Versioned policy weights on the wire: a named-tensor dict <-> a checksummed, chunked Weights stream.

The learner encodes each published version once (`encode_weights`) and every subscriber is sent
the same prebuilt chunk messages. The receiver feeds chunks to a `WeightsAssembler`, which verifies
order and checksum before handing out the arrays. Numpy only: no torch here.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable

import numpy as np

from kuberl.v1 import common_pb2 as pb
from services.common.protocol.tensors import TensorError, check_shape, dtype_code, numpy_dtype

DEFAULT_CHUNK_BYTES = 1 << 20


def encode_weights(version: int, tensors: dict[str, np.ndarray],
                   chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[pb.Weights]:
    """Encode named arrays as the chunk messages of one version (at least one chunk)."""
    specs, parts, offset = [], [], 0
    for name, arr in tensors.items():
        arr = np.asarray(arr)  # keeps 0-d shapes (ascontiguousarray would make them (1,))
        code = dtype_code(arr.dtype)
        data = arr.astype(numpy_dtype(code), copy=False).tobytes(order="C")
        specs.append(pb.TensorSpec(name=name, dtype=code, shape=arr.shape, offset=offset))
        parts.append(data)
        offset += len(data)
    payload = b"".join(parts)
    checksum = hashlib.sha256(payload).hexdigest()
    n = max(1, math.ceil(len(payload) / chunk_bytes))
    return [pb.Weights(version=version, checksum=checksum, chunk_index=i, num_chunks=n,
                       total_bytes=len(payload), specs=specs if i == 0 else (),
                       data=payload[i * chunk_bytes:(i + 1) * chunk_bytes]) for i in range(n)]


class WeightsAssembler:
    """Collects the chunks of one version at a time; `add` returns (version, arrays) when complete.

    A chunk out of order or a checksum mismatch raises TensorError; the partial version is discarded
    and the assembler waits for the next chunk 0.
    """

    def __init__(self) -> None:
        self._chunks: list[bytes] = []
        self._head: pb.Weights | None = None

    def add(self, chunk: pb.Weights) -> tuple[int, dict[str, np.ndarray]] | None:
        """`take` and, once the version is complete, `assemble`."""
        return self.assemble() if self.take(chunk) else None

    def take(self, chunk: pb.Weights) -> bool:
        """Keep `chunk`; True when it completes its version (then `assemble` it). Cheap: a caller on
        an event loop takes chunks there and assembles in a thread."""
        if chunk.chunk_index == 0:
            self._head, self._chunks = chunk, []
        head = self._head
        if head is None or chunk.version != head.version or chunk.chunk_index != len(self._chunks):
            self._head, self._chunks = None, []
            raise TensorError("weights.chunk_index", f"chunk {chunk.chunk_index} of version "
                                                     f"{chunk.version} arrived out of order")
        self._chunks.append(chunk.data)
        return len(self._chunks) >= head.num_chunks

    def assemble(self) -> tuple[int, dict[str, np.ndarray]]:
        """(version, arrays) of the version `take` completed: joined and checked against its checksum
        (megabytes of hashing for a CNN). The assembler is ready for the next version after it."""
        head, chunks = self._head, self._chunks
        self._head, self._chunks = None, []
        if head is None or len(chunks) < head.num_chunks:
            raise TensorError("weights.num_chunks", "no complete version to assemble")
        payload = b"".join(chunks)
        if len(payload) != head.total_bytes or hashlib.sha256(payload).hexdigest() != head.checksum:
            raise TensorError("weights.checksum", f"version {head.version} failed its checksum")
        return head.version, _split(head.specs, payload)


def _split(specs: Iterable[pb.TensorSpec], payload: bytes) -> dict[str, np.ndarray]:
    out = {}
    for spec in specs:
        dt = numpy_dtype(spec.dtype, f"weights.specs[{spec.name}].dtype")
        dims = check_shape(spec.shape, f"weights.specs[{spec.name}].shape")
        size = math.prod(dims) * dt.itemsize
        if spec.offset + size > len(payload):
            raise TensorError(f"weights.specs[{spec.name}]", "extends past the end of the payload")
        out[spec.name] = np.frombuffer(payload, dtype=dt, count=math.prod(dims), offset=spec.offset).reshape(dims)
    return out

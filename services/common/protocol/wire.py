"""Zero-copy reading of the protobuf wire format, for the one message whose payload is large.

The protobuf runtime copies every bytes field when it parses a message, and reading `tensor.data`
copies it again; for a 512 KB trajectory fragment that is most of what a buffer spends per push.
`fields` walks the wire format instead and hands out `memoryview` slices of the received buffer, so
tensors decode to numpy views of the very bytes gRPC delivered (services/common/protocol/fragments.py builds a
`RawFragment` from them). Only the buffer's push path uses this; everything else uses the generated
classes. Malformed input raises WireError with the byte offset; nothing here allocates per byte.
"""

from __future__ import annotations

from collections.abc import Iterator

VARINT, FIXED64, LEN, FIXED32 = 0, 1, 2, 5
MAX_VARINT_BYTES = 10


class WireError(ValueError):
    """The bytes are not a well-formed protobuf message."""


def read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    """The unsigned varint at `pos` and the position after it."""
    if pos < len(buf) and buf[pos] < 0x80:  # one byte: most keys, lengths of small fields, dtypes
        return buf[pos], pos + 1
    result = shift = 0
    end = min(len(buf), pos + MAX_VARINT_BYTES)
    while pos < end:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
    raise WireError(f"truncated or over-long varint at byte {pos}")


def fields(buf: memoryview) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) for each field in order: an int for VARINT, FIXED64 and
    FIXED32 (raw little-endian bits), a memoryview slice of `buf` (no copy) for LEN."""
    pos, n = 0, len(buf)
    while pos < n:
        key, pos = read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        value: int | memoryview
        if number == 0:
            raise WireError(f"field number 0 at byte {pos}")
        if wire_type == VARINT:
            value, pos = read_varint(buf, pos)
        elif wire_type == LEN:
            length, pos = read_varint(buf, pos)
            if pos + length > n:
                raise WireError(f"field {number} claims {length} bytes at byte {pos}, only {n - pos} remain")
            value, pos = buf[pos:pos + length], pos + length
        elif wire_type in (FIXED64, FIXED32):
            size = 8 if wire_type == FIXED64 else 4
            if pos + size > n:
                raise WireError(f"field {number} truncated at byte {pos}")
            value, pos = int.from_bytes(buf[pos:pos + size], "little"), pos + size
        else:
            raise WireError(f"field {number} has unsupported wire type {wire_type} at byte {pos}")
        yield number, wire_type, value


def packed_varints(value: int | memoryview, wire_type: int) -> list[int]:
    """The elements of a repeated integer field occurrence (packed LEN or one unpacked VARINT)."""
    # (`fields` gives a VARINT's value as an int and a LEN's as a memoryview: the isinstance tests only narrow)
    if wire_type == VARINT and isinstance(value, int):
        return [value]
    if wire_type != LEN or not isinstance(value, memoryview):
        raise WireError(f"repeated integer field with wire type {wire_type}")
    out, pos = [], 0
    while pos < len(value):
        v, pos = read_varint(value, pos)
        out.append(v)
    return out


def as_int64(v: int) -> int:
    """Two's-complement reading of a varint holding an int64 (negative values take 10 bytes)."""
    return v - (1 << 64) if v >= 1 << 63 else v


def varint(value: int) -> bytes:
    """The unsigned varint encoding of `value` (>= 0)."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def len_prefix(number: int, length: int) -> bytes:
    """Key and length of a LEN field `number` whose value is `length` bytes long."""
    return varint(number << 3 | LEN) + varint(length)

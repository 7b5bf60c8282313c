"""The zero-copy fragment path: encode_fragment writes exactly what the protobuf runtime writes, and
RawFragment reads serialized bytes as decode_fragment expects, refusing malformed bytes by name."""

from __future__ import annotations

import numpy as np
import pytest

from kuberl.v1 import common_pb2 as pb
from services.common.protocol import wire
from services.common.protocol.fragments import RawFragment, build_fragment, decode_fragment, encode_fragment
from services.common.protocol.tensors import TensorError, encode_parts, encode
from tests.unit.fragment_factory import DQN, PPO, fragment_arrays

T, N = 4, 3


def kwargs(algorithm=PPO, **over):
    arrays = fragment_arrays(T, N, (2, 5), terminated=[(1, 0)], truncated=[(3, 2)], obs_dtype=np.uint8,
                             with_logprob=algorithm == PPO)
    return {"actor_id": "actor-ü", "seq": 300, "policy_version": 2**40, "algorithm": algorithm,
            "incarnation": 2**64 - 3, "env_ids": [0, 7, 129], **arrays, **over}


@pytest.mark.parametrize("algorithm", [PPO, DQN])
def test_encode_fragment_is_byte_identical_to_the_protobuf_runtime(algorithm):
    kw = kwargs(algorithm)
    msg = build_fragment(**kw)
    enc = encode_fragment(**kw, created_unix_s=msg.created_unix_s)
    assert enc.payload == msg.SerializeToString()
    assert (enc.seq, enc.samples) == (300, T * N)


def test_defaults_and_layouts_encode_identically():
    # seq 0 and version 0 are left out by proto3; a strided (non-contiguous) obs is copied to C order;
    # float64 rewards are converted as build_fragment converts them.
    kw = kwargs(seq=0, policy_version=0, incarnation=0)
    kw["obs"] = np.asfortranarray(kw["obs"])
    kw["rewards"] = kw["rewards"].astype(np.float64)
    msg = build_fragment(**kw)
    assert encode_fragment(**kw, created_unix_s=msg.created_unix_s).payload == msg.SerializeToString()
    head, data = encode_parts(np.zeros((0, 3), np.float32))
    assert head + bytes(data) == encode(np.zeros((0, 3), np.float32)).SerializeToString()


def test_raw_fragment_decodes_as_the_message_does_and_shares_its_bytes():
    msg = build_fragment(**kwargs())
    data = msg.SerializeToString()
    raw = RawFragment(data)
    assert raw.error is None
    assert (raw.actor_id, raw.seq, raw.policy_version, raw.env_ids) == ("actor-ü", 300, 2**40, [0, 7, 129])
    assert raw.incarnation == 2**64 - 3
    assert raw.created_unix_s == msg.created_unix_s
    a, b = decode_fragment(raw, algorithm=PPO), decode_fragment(msg, algorithm=PPO)
    assert set(a.extras) == set(b.extras) == {"behaviour_logprob"}
    for name in ("obs", "actions", "rewards", "terminated", "truncated", "final_obs", "final_index",
                 "extras.behaviour_logprob"):
        x, y = ((a.extras[name[7:]], b.extras[name[7:]]) if name.startswith("extras.")
                else (getattr(a, name), getattr(b, name)))
        assert x.dtype == y.dtype and x.shape == y.shape, name
        np.testing.assert_array_equal(x, y, err_msg=name)
        assert not x.flags.writeable, name
    assert np.shares_memory(a.obs, np.frombuffer(data, np.uint8))  # a view of the received bytes
    assert raw.to_message() == msg


def test_negative_dims_and_unknown_fields():
    msg = build_fragment(**kwargs())
    msg.obs.shape[0] = -1  # an int64 varint of 10 bytes
    raw = RawFragment(msg.SerializeToString() + wire.varint(99 << 3 | wire.VARINT) + wire.varint(5))
    assert raw.error is None  # field 99 is unknown: skipped, as protobuf does
    with pytest.raises(TensorError, match=r"^obs.shape: dimension 0 is negative \(-1\)"):
        decode_fragment(raw)


@pytest.mark.parametrize("mangle, expected", [
    (lambda b: b[:-3], r"malformed TrajectoryFragment: .*"),
    (lambda b: b + bytes([0x80]), r"malformed TrajectoryFragment: truncated or over-long varint"),
    (lambda b: b + bytes([10 << 3 | 0]) + b"\x01", r"malformed TrajectoryFragment: obs has wire type 0"),
    (lambda b: b + bytes([3 << 3 | 2, 1, 0]), r"malformed TrajectoryFragment: policy_version has wire type 2"),
    (lambda b: b + bytes([0x07]), r"malformed TrajectoryFragment: field number 0 at byte \d+"),
    (lambda b: b + bytes([1 << 3 | 3]), r"malformed TrajectoryFragment: field 1 has unsupported wire type 3"),
    (lambda b: b + bytes([1 << 3 | 2, 2, 0xC3, 0x28]), r"malformed TrajectoryFragment: .*utf-8"),
])
def test_malformed_bytes_are_refused_naming_the_fragment(mangle, expected):
    good = build_fragment(**kwargs()).SerializeToString()
    raw = RawFragment(mangle(good))
    with pytest.raises(TensorError, match=r"^fragment: " + expected):
        decode_fragment(raw)


def test_a_tensor_field_given_twice_is_refused():
    msg = build_fragment(**kwargs())
    extra = pb.TrajectoryFragment(rewards=msg.rewards).SerializeToString()
    with pytest.raises(TensorError, match=r"^fragment: malformed TrajectoryFragment: rewards appears twice"):
        decode_fragment(RawFragment(msg.SerializeToString() + extra))


def test_varints_round_trip():
    for v in (0, 1, 127, 128, 300, 2**32, 2**63 - 1, 2**64 - 1):
        enc = wire.varint(v)
        assert wire.read_varint(memoryview(enc), 0) == (v, len(enc))
    assert wire.as_int64(2**64 - 1) == -1
    with pytest.raises(wire.WireError, match="over-long varint"):
        wire.read_varint(memoryview(b"\xff" * 11), 0)

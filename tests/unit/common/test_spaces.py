"""services/common/protocol/spaces.py: action spaces from gymnasium and the wire, and every refusal naming its field."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest

from kuberl.v1 import actor_pb2
from kuberl.v1 import common_pb2 as pb
from services.common.protocol import spaces
from services.common.protocol.spaces import Box, Discrete, MultiDiscrete, check_actions, check_mask, from_gymnasium, from_proto, to_proto
from services.common.protocol.tensors import TensorError

SPACES = [Discrete(3), MultiDiscrete((4, 3)), Box.of((2,), -2.0, [1.0, 3.0]), Box.of((2, 2), -math.inf, math.inf)]


@pytest.mark.parametrize("space", SPACES, ids=str)
def test_wire_round_trip(space):
    msg = actor_pb2.Space()
    to_proto(space, msg)
    assert from_proto(msg) == space


def test_from_gymnasium():
    assert from_gymnasium(gym.spaces.Discrete(5)) == Discrete(5)
    assert from_gymnasium(gym.spaces.MultiDiscrete([2, 7])) == MultiDiscrete((2, 7))
    box = from_gymnasium(gym.spaces.Box(-1.0, 2.0, (3,), np.float32))
    assert box.shape == (3,) and box.low == (-1.0,) * 3 and box.high == (2.0,) * 3 and box.bounded
    for bad, words in ((gym.spaces.Discrete(3, start=1), "start"), (gym.spaces.Box(0, 3, (2,), np.int64), "floating"),
                       (gym.spaces.MultiDiscrete([[2, 2], [2, 2]]), "1-d"), (gym.spaces.MultiBinary(3), "is not")):
        with pytest.raises(ValueError, match=words):
            from_gymnasium(bad)


def _box(shape, low=(), high=(), dtype=pb.DTYPE_FLOAT32):
    msg = actor_pb2.Space()
    msg.box.shape.extend(shape)
    msg.box.dtype = dtype
    msg.box.low.extend(low)
    msg.box.high.extend(high)
    return msg


def test_box_bounds_on_the_wire():
    assert from_proto(_box([2], [-1.0], [1.0])) == Box.of((2,), -1.0, 1.0)          # one value: every element
    assert from_proto(_box([2], [], [])).low == (-math.inf, -math.inf)                # none: unbounded
    assert from_proto(_box([2], [0.0, 1.0], [2.0, 3.0])).high == (2.0, 3.0)           # one per element


@pytest.mark.parametrize("msg,words", [
    (actor_pb2.Space(), "nothing is not an action space"),
    (_box([2], [0.0, 1.0, 2.0]), "low has 3 values"),
    (_box([2], [1.0], [0.0]), "low <= high"),
    (_box([2], [float("nan")]), "low <= high"),
    (_box([2], dtype=pb.DTYPE_INT64), "DTYPE_FLOAT32"),
    (_box([2], dtype=pb.DTYPE_UNSPECIFIED), "dtype is unspecified"),
    (_box([0]), "every dim >= 1"),
    (_box([]), "rank 1"),
    (actor_pb2.Space(discrete=actor_pb2.DiscreteSpace(n=0)), "n = 0"),
    (actor_pb2.Space(multi_discrete=actor_pb2.MultiDiscreteSpace(nvec=[])), "1..64 choices"),
    (actor_pb2.Space(multi_discrete=actor_pb2.MultiDiscreteSpace(nvec=[3, 0])), "1..64 choices"),
    (actor_pb2.Space(dict=actor_pb2.DictSpace()), "dict is not an action space"),
])
def test_refusals_name_the_field(msg, words):
    with pytest.raises(TensorError, match=words) as err:
        from_proto(msg, "hello.action_space")
    assert err.value.field.startswith("hello.action_space")


def test_check_actions_layout_and_values():
    check_actions(Discrete(3), np.array([0, 2]), (2,))
    check_actions(MultiDiscrete((4, 3)), np.array([[3, 2]]), (1,))
    check_actions(Box.of((2,), -1, 1), np.array([[5.0, -7.0]], np.float32), (1,))  # unclipped samples are valid
    for space, arr, lead, words in (
            (Discrete(3), np.array([3, 0]), (2,), "0..n-1"), (Discrete(3), np.array([-1, 0]), (2,), "0..n-1"),
            (Discrete(3), np.array([[0]]), (1,), r"int64 \[1\]"),
            (MultiDiscrete((4, 3)), np.array([[3, 3]]), (1,), "0..n-1"),
            (MultiDiscrete((4, 3)), np.array([0, 1]), (1,), r"\[1, 2\]"),
            (Box.of((2,), -1, 1), np.array([[np.nan, 0]], np.float32), (1,), "NaN"),
            (Box.of((2,), -1, 1), np.zeros((1, 2), np.float64), (1,), "float32")):
        with pytest.raises(TensorError, match=words):
            check_actions(space, arr, lead, "actions")


def test_check_mask():
    space = MultiDiscrete((2, 2))
    check_mask(space, np.array([[True, False, False, True]]), (1,))
    with pytest.raises(TensorError, match="choice 1"):
        check_mask(space, np.array([[True, False, False, False]]), (1,))
    with pytest.raises(TensorError, match=r"bool \[1, 4\]"):
        check_mask(space, np.ones((1, 3), bool), (1,))
    with pytest.raises(TensorError, match="takes no action mask"):
        check_mask(Box.of((1,), -1, 1), np.ones((1, 1), bool), (1,))


def test_box_clip():
    box = Box.of((2,), [-1.0, 0.0], [1.0, 2.0])
    np.testing.assert_array_equal(box.clip(np.array([[-3.0, 5.0]], np.float32)), [[-1.0, 2.0]])


# -- Dict observations ------------------------------------------------------------------------------
def test_a_dict_layout_is_sorted_and_flattens_like_gymnasium():
    gspace = gym.spaces.Dict({"vel": gym.spaces.Box(-1, 1, (2,)), "pos": gym.spaces.Box(-1, 1, (2, 3))})
    layout = spaces.dict_layout({k: s.shape for k, s in gspace.spaces.items()})
    assert layout == (("pos", (2, 3)), ("vel", (2,))) and spaces.flat_size(layout) == 8
    sample = gspace.sample()
    flat = spaces.flatten_dict({k: v[None] for k, v in sample.items()}, layout, (1,))
    np.testing.assert_array_equal(flat[0], gym.spaces.flatten(gspace, sample).astype(np.float32))
    assert flat.dtype == np.float32


def test_dict_layouts_round_trip_through_the_wire_and_bad_ones_name_the_field():
    layout = spaces.dict_layout({"b": (1,), "a": (2, 2)})
    msg = actor_pb2.DictSpace()
    spaces.dict_layout_to_proto(layout, msg)
    assert spaces.dict_layout_from_proto(msg) == layout
    for bad, text in (({}, "1..64 keys"), ({"a": (0,)}, "every dim >= 1"), ({"x" * 65: (1,)}, "1..64 characters")):
        with pytest.raises(ValueError, match=text):
            spaces.dict_layout(bad)
    msg.spaces["a"].dtype = 42
    with pytest.raises(TensorError, match="observation_space.dict.spaces\\['a'\\].dtype"):
        spaces.dict_layout_from_proto(msg)


def test_flatten_dict_refuses_other_keys_and_shapes():
    layout = spaces.dict_layout({"a": (2,)})
    with pytest.raises(ValueError, match="differ from the declared"):
        spaces.flatten_dict({"b": np.zeros((1, 2))}, layout, (1,))
    with pytest.raises(ValueError, match=r"observation\['a'\]: shape \[1, 3\], expected \[1, 2\]"):
        spaces.flatten_dict({"a": np.zeros((1, 3))}, layout, (1,))

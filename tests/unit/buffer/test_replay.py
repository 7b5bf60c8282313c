"""services/buffer/replay.py: the uniform replay ring."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from services.buffer.replay import ReplayRing
from services.common.protocol.fragments import build_fragment, decode_fragment
from services.common.protocol.tensors import TensorError
from tests.unit.fragment_factory import DQN, fragment_arrays, make_fragment

# A fragment of T=2 steps of N=2 envs holds 4 transitions with rewards base..base+3.


def frag(base=0, T=2, N=2, **kw):
    return make_fragment(T, N, algorithm=DQN, base=base, **kw)


def stored_rewards(ring: ReplayRing, draws: int = 2000) -> set[float]:
    return set(ring.sample(draws)["rewards"].tolist())


def test_size_grows_then_caps_and_wraps_over_oldest():
    ring = ReplayRing(capacity=10)
    sizes = []
    for base in (0, 4, 8):
        assert ring.add(frag(base)) == 4
        sizes.append(ring.size)
    assert sizes == [4, 8, 10]
    # rewards 0 and 1 (the two oldest) were overwritten by 10 and 11
    assert stored_rewards(ring) == set(range(2, 12))
    ring.add(frag(12))
    assert ring.size == 10
    assert stored_rewards(ring) == set(range(6, 16))


def test_rows_stay_consistent_across_wrap_around():
    ring = ReplayRing(capacity=6, seed=1)
    for base in (0, 4, 8, 12):
        ring.add(frag(base, policy_version=base))
    rows = ring.sample(500)
    # Fragment layout: obs[0] == 10 * reward, next_obs == obs + 10 * N, version = fragment base.
    np.testing.assert_array_equal(rows["obs"][:, 0], rows["rewards"] * 10)
    np.testing.assert_array_equal(rows["next_obs"], rows["obs"] + 20)
    np.testing.assert_array_equal(rows["policy_version"], (rows["rewards"] // 4) * 4)
    np.testing.assert_array_equal(rows["actions"], rows["rewards"].astype(np.int64) % 2)
    assert set(rows["rewards"].tolist()) == set(range(10, 16))


def test_next_obs_at_done_steps_is_the_final_obs():
    ring = ReplayRing(capacity=16)
    ring.add(frag(0, T=3, terminated=[(1, 0)], truncated=[(0, 1)]))
    rows = ring.sample(2000)
    by_reward = {r: (o, n, t) for r, o, n, t in zip(rows["rewards"].tolist(), rows["obs"], rows["next_obs"],
                                                     rows["terminated"])}
    assert set(by_reward) == set(range(6))
    # flat 2 = (t=1, n=0) terminated; flat 1 = (t=0, n=1) truncated: both end with final_obs
    np.testing.assert_array_equal(by_reward[2][1], [-21, -22, -23])
    assert by_reward[2][2]
    np.testing.assert_array_equal(by_reward[1][1], [-11, -12, -13])
    assert not by_reward[1][2]  # truncation is not termination: the learner bootstraps
    for r in (0, 3, 4, 5):
        obs, nxt, term = by_reward[r]
        np.testing.assert_array_equal(nxt, obs + 20)
        assert not term


def test_sample_shapes_and_dtypes():
    ring = ReplayRing(capacity=32)
    ring.add(frag(0, T=4, policy_version=3))
    rows = ring.sample(5)
    assert set(rows) == {"obs", "actions", "rewards", "next_obs", "terminated", "policy_version"}
    expected = {"obs": ((5, 3), np.float32), "next_obs": ((5, 3), np.float32), "actions": ((5,), np.int64),
                "rewards": ((5,), np.float32), "terminated": ((5,), np.bool_),
                "policy_version": ((5,), np.int64)}
    for name, (shape, dtype) in expected.items():
        assert rows[name].shape == shape, name
        assert rows[name].dtype == dtype, name
    assert (rows["policy_version"] == 3).all()


def test_sample_keeps_obs_dtype_and_shape():
    ring = ReplayRing(capacity=32)
    ring.add(frag(0, obs_shape=(2, 2), obs_dtype=np.uint8))
    rows = ring.sample(3)
    assert rows["obs"].shape == (3, 2, 2) and rows["obs"].dtype == np.uint8
    assert rows["next_obs"].shape == (3, 2, 2) and rows["next_obs"].dtype == np.uint8


def test_sample_returns_fresh_arrays():
    ring = ReplayRing(capacity=4)
    ring.add(frag(0))
    rows = ring.sample(100)
    rows["rewards"][:] = -1
    rows["obs"][:] = -1
    again = ring.sample(100)
    assert set(again["rewards"].tolist()) == {0, 1, 2, 3}
    np.testing.assert_array_equal(again["obs"][:, 0], again["rewards"] * 10)


def test_sample_only_returns_stored_rows():
    ring = ReplayRing(capacity=1000)
    ring.add(frag(0))
    assert ring.size == 4
    assert stored_rewards(ring, 5000) == {0, 1, 2, 3}


def test_sample_from_empty_ring_raises():
    with pytest.raises(ValueError, match="empty"):
        ReplayRing(capacity=4).sample(1)


def test_sampling_is_roughly_uniform():
    ring = ReplayRing(capacity=4, seed=0)
    ring.add(frag(0))
    counts = Counter(ring.sample(40_000)["rewards"].tolist())
    assert set(counts) == {0, 1, 2, 3}
    for reward, count in counts.items():
        assert 0.2 < count / 40_000 < 0.3, (reward, count)


def test_same_seed_samples_same_rows():
    a, b = ReplayRing(capacity=8, seed=5), ReplayRing(capacity=8, seed=5)
    a.add(frag(0))
    b.add(frag(0))
    np.testing.assert_array_equal(a.sample(50)["rewards"], b.sample(50)["rewards"])


@pytest.mark.parametrize("kw,field", [
    ({"obs_shape": (4,)}, "obs"),
    ({"obs_dtype": np.float64}, "obs"),
])
def test_obs_mismatch_on_later_insert_raises_without_modifying_ring(kw, field):
    ring = ReplayRing(capacity=6)
    ring.add(frag(0))
    ring.add(frag(4))  # wraps: ring holds 2..7, next write at position 2
    with pytest.raises(TensorError, match="differs from this buffer's") as e:
        ring.add(frag(100, **kw))
    assert e.value.field == field
    assert ring.size == 6
    assert stored_rewards(ring) == set(range(2, 8))
    ring.add(frag(8))  # the write position did not move either: 2..5 are the next to go
    assert stored_rewards(ring) == set(range(6, 12))


def test_actions_mismatch_raises_without_side_effects():
    ring = ReplayRing(capacity=8)
    ring.add(frag(0))
    arrays = fragment_arrays(2, 2, with_logprob=False)
    arrays["actions"] = np.zeros((2, 2, 1), np.int64)  # per-step action shape (1,) instead of ()
    bad = decode_fragment(build_fragment(actor_id="a", seq=1, policy_version=0, algorithm=DQN,
                                         env_ids=range(2), **arrays))
    with pytest.raises(TensorError, match=r"int64 \[1\] per step differs from this buffer's int64 \[\]") as e:
        ring.check(bad)
    assert e.value.field == "actions"
    with pytest.raises(TensorError):
        ring.add(bad)
    assert ring.size == 4
    assert stored_rewards(ring) == {0, 1, 2, 3}


def test_check_before_first_insert_accepts_anything():
    ReplayRing(capacity=4).check(frag(0, obs_shape=(7,)))


def test_fragment_larger_than_capacity_keeps_its_newest_rows():
    ring = ReplayRing(capacity=5)
    assert ring.add(frag(0, T=4)) == 8
    assert ring.size == 5
    assert stored_rewards(ring) == {3, 4, 5, 6, 7}
    ring.add(frag(100, T=1))  # the next insert overwrites the oldest of those (3 and 4)
    assert stored_rewards(ring) == {5, 6, 7, 100, 101}


def test_fragment_larger_than_capacity_into_partly_filled_ring():
    ring = ReplayRing(capacity=5)
    ring.add(frag(0, T=1))          # rewards 0, 1
    ring.add(frag(10, T=4))         # 8 rows; keeps 13..17
    assert ring.size == 5
    assert stored_rewards(ring) == {13, 14, 15, 16, 17}
    ring.add(frag(100, T=1))
    assert stored_rewards(ring) == {15, 16, 17, 100, 101}

"""services/buffer/compact.py: stacked frames stored once, transitions rebuilt exactly as they came;
the Store's choice of layout (buffer.compact_replay), early evictions counted, checkpoints, and the
memory a Pong replay of 1M transitions takes."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from services.buffer.checkpoint import BufferCheckpointer
from services.buffer.compact import CompactReplay, frame_ring_size
from services.buffer.replay import ReplayRing
from services.buffer.store import Outcome, Store
from services.config import ConfigError, config_from_dict
from services.common.protocol.fragments import TRANSITION_FIELDS, Fragment, build_fragment, decode_fragment
from services.common.stats import Metrics
from services.common.protocol.tensors import TensorError
from tests.unit.fragment_factory import DQN, FrameEnvs, make_msg

DQN_FIELDS = list(TRANSITION_FIELDS)


def transitions(frag: Fragment) -> dict[str, np.ndarray]:
    """The naive reference: every transition of `frag` with its own obs and next_obs, time-major."""
    n = frag.num_samples
    return {"obs": frag.obs[:-1].reshape(n, *frag.obs.shape[2:]), "actions": frag.actions.reshape(n),
            "rewards": frag.rewards.reshape(n), "next_obs": frag.next_obs().reshape(n, *frag.obs.shape[2:]),
            "terminated": frag.terminated.reshape(n), "policy_version": np.full(n, frag.policy_version, np.int64)}


class Reference:
    """Every transition added, in order: a ring holds the newest `size` of them."""

    def __init__(self):
        self.parts: list[dict[str, np.ndarray]] = []

    def add(self, ring, frag: Fragment) -> None:
        assert ring.add(frag) == frag.num_samples
        self.parts.append(transitions(frag))

    @property
    def total(self) -> int:
        return sum(len(p["rewards"]) for p in self.parts)

    def assert_held(self, ring: CompactReplay) -> None:
        held = ring.gather(np.arange(ring.size))
        for name in DQN_FIELDS:
            want = np.concatenate([p[name] for p in self.parts])[self.total - ring.size:]
            np.testing.assert_array_equal(held[name], want, err_msg=name)
            assert held[name].dtype == want.dtype, name


def random_stream(seed: int, ring: CompactReplay, fragments: int = 60, *, shift: bool = True) -> Reference:
    """Fragments of 3 actors (1 to 3 envs each, 1 to 5 steps) interleaved at random, with episode ends,
    truncations, an actor restarted under a new incarnation, re-sent and late fragments."""
    rng = np.random.default_rng(seed)
    actors = {f"actor-{a}": [FrameEnvs(a + 1, seed=seed * 10 + a, p_end=0.15, shift=shift), 0] for a in range(3)}
    ref, sent, held_back = Reference(), [], []
    incarnation = {name: 1 for name in actors}
    for _ in range(fragments):
        name = f"actor-{rng.integers(3)}"
        envs, seq = actors[name]
        if rng.random() < 0.05:  # the actor restarts: new process, new incarnation, fresh envs
            incarnation[name] += 1
            envs = actors[name][0] = FrameEnvs(len(envs.stacks), seed=int(rng.integers(1 << 30)), shift=shift)
        frag = decode_fragment(envs.fragment(int(rng.integers(1, 6)), actor_id=name, seq=seq, incarnation=incarnation[name],
                                     policy_version=seq, env_ids=[10 * i for i in range(len(envs.stacks))]))
        actors[name][1] += 1
        roll = rng.random()
        if roll < 0.1:
            held_back.append(frag)  # arrives later, after newer ones of the same actor
            continue
        ref.add(ring, frag)
        sent.append(frag)
        if roll > 0.92:  # re-sent (the ring itself stores what it is given; the Store dedupes)
            ref.add(ring, sent[int(rng.integers(len(sent)))])
        if held_back and rng.random() < 0.3:
            ref.add(ring, held_back.pop(0))
        ref.assert_held(ring)
    return ref


@pytest.mark.parametrize("seed", range(6))
def test_random_streams_are_stored_exactly_and_wrap_around(seed):
    ring = CompactReplay(capacity=40, seed=seed, frames=400)  # frames to spare: only the rows wrap
    ref = random_stream(seed, ring)
    assert ref.total > 3 * ring.capacity and ring.size == ring.capacity
    assert ring.evicted_early == 0
    assert ring.frames_written < 4 * ref.total  # frames shared (a ReplayRing stores 8 per transition)


@pytest.mark.parametrize("seed", range(3))
def test_random_streams_with_default_sizing_hold_the_newest(seed):
    ring = CompactReplay(capacity=50, seed=seed)
    random_stream(seed, ring, fragments=80)  # checks what is held after every fragment
    assert 0 < ring.size <= ring.capacity
    assert ring.num_frames == frame_ring_size(50, 4)[0]


@pytest.mark.parametrize("seed", range(3))
def test_stacks_that_do_not_shift_are_stored_whole(seed):
    ring = CompactReplay(capacity=30, seed=seed, frames=4000)
    ref = random_stream(seed, ring, fragments=40, shift=False)
    assert ring.evicted_early == 0
    # No stack continues another (random stacks; an episode's final one is new too): K frames each.
    assert ring.frames_written >= 4 * ref.total


def test_a_steady_stream_costs_one_frame_per_transition():
    envs, ring, ref = FrameEnvs(3, p_end=0.0, seed=1), CompactReplay(capacity=1000), Reference()
    for seq in range(10):
        ref.add(ring, decode_fragment(envs.fragment(4, seq=seq)))
    # 4 frames to start each env's chain, then one per step: fragments go on from the one before.
    assert ring.frames_written == 3 * 4 + ref.total
    ref.assert_held(ring)


def test_an_episode_end_costs_one_stack():
    envs, ring, ref = FrameEnvs(1, p_end=0.0, seed=2), CompactReplay(capacity=100), Reference()
    ref.add(ring, decode_fragment(envs.fragment(3)))
    envs.p_end = 1.0  # every step ends an episode: final_obs moves on (1 frame), the next starts anew (4)
    ref.add(ring, decode_fragment(envs.fragment(2, seq=1)))
    assert ring.frames_written == (4 + 3) + 2 * (1 + 4)
    ref.assert_held(ring)


@pytest.mark.parametrize("first_of_next, new_frames", [
    ("obs", 4 + 1 + 4),    # the next episode's first stack moves obs[0] on, not final_obs: stored whole
    ("final", 4 + 1 + 1),  # it moves final_obs on: one frame
])
def test_after_an_episode_end_the_next_stack_is_compared_with_final_obs(first_of_next, new_frames):
    f = np.random.default_rng(14).integers(0, 256, (7, 6, 6), dtype=np.uint8)  # seven distinct frames
    obs0, final = f[[0, 1, 2, 3]], f[[1, 2, 3, 4]]
    obs1 = f[[1, 2, 3, 5]] if first_of_next == "obs" else f[[2, 3, 4, 5]]
    ring, ref = CompactReplay(capacity=4), Reference()
    ref.add(ring, one_step("a", 0, obs0, obs1, final))
    assert ring.frames_written == new_frames
    ref.assert_held(ring)
    # The next fragment goes on from obs1's frames (1 new frame) only if they were stored right.
    ref.add(ring, one_step("a", 1, obs1, np.concatenate([obs1[1:], f[6:]])))
    assert ring.frames_written == new_frames + 1
    ref.assert_held(ring)


def one_step(actor_id: str, seq: int, obs: np.ndarray, nxt: np.ndarray, final: np.ndarray | None = None) -> Fragment:
    """A fragment of one step of one env, ending its episode (terminated) where `final` is given."""
    ended = np.full((1, 1), final is not None)
    finals = final[None] if final is not None else np.zeros((0, *obs.shape), obs.dtype)
    return decode_fragment(build_fragment(
        actor_id=actor_id, seq=seq, policy_version=seq, algorithm=DQN, env_ids=[0],
        obs=np.stack([obs, nxt])[:, None], actions=np.zeros((1, 1), np.int64), rewards=np.zeros((1, 1), np.float32),
        terminated=ended, truncated=np.zeros((1, 1), bool), final_obs=finals,
        final_index=np.zeros(len(finals), np.int64)))


def test_frames_are_compared_by_their_bytes_not_their_values():
    obs0 = np.array([[1, 2, 3], [0.0, 0.0, 0.0]], np.float32)
    obs1 = np.array([[-0.0, 0.0, 0.0], [4, 5, 6]], np.float32)  # equal values to obs0[1:], other bytes
    ring, ref = CompactReplay(capacity=4), Reference()
    ref.add(ring, one_step("a", 0, obs0, obs1))
    assert ring.frames_written == 2 + 2
    assert np.signbit(ring.gather(np.arange(1))["next_obs"][0, 0, 0])
    ref.assert_held(ring)


def test_a_chain_goes_on_only_from_its_own_env_and_equal_frames():
    a, b = FrameEnvs(1, p_end=0, seed=3), FrameEnvs(1, p_end=0, seed=4)
    ring, ref = CompactReplay(capacity=100), Reference()
    ref.add(ring, decode_fragment(a.fragment(2, actor_id="a")))
    ref.add(ring, decode_fragment(b.fragment(2, actor_id="b")))
    written = ring.frames_written
    ref.add(ring, decode_fragment(b.fragment(2, actor_id="a", seq=1)))  # a's chain, but b's frames: not equal
    assert ring.frames_written == written + 4 + 2
    ref.add(ring, decode_fragment(a.fragment(2, actor_id="a", seq=1, incarnation=5)))  # a new incarnation: its own chain
    assert ring.frames_written == written + 2 * (4 + 2)
    ref.assert_held(ring)


def test_a_chain_does_not_go_on_from_frames_older_than_the_lag():
    envs, ring, ref = FrameEnvs(1, p_end=0, seed=5), CompactReplay(capacity=100, lag=6), Reference()
    ref.add(ring, decode_fragment(envs.fragment(2, actor_id="slow")))
    ref.add(ring, decode_fragment(FrameEnvs(1, p_end=0, seed=6).fragment(4, actor_id="fast")))  # 8 frames later
    written = ring.frames_written
    ref.add(ring, decode_fragment(envs.fragment(2, actor_id="slow", seq=1)))
    assert ring.frames_written == written + 4 + 2
    ref.assert_held(ring)


def test_a_fragment_needing_more_frames_than_the_ring_is_stored_in_parts():
    ring, ref = CompactReplay(capacity=60, frames=14), Reference()  # room for 3 stacks of 4 and a bit
    for seq in range(4):
        ref.add(ring, decode_fragment(FrameEnvs(3, p_end=0.3, seed=seq, shift=seq % 2 == 0).fragment(5, seq=seq)))
        ref.assert_held(ring)
    assert ring.size >= 1 and ring.evicted_early > 0


def test_frames_running_out_evict_early_and_are_counted():
    # Rows for 1,000 transitions but frames for 40: stacks that do not shift take 4 new frames each.
    ring, ref = CompactReplay(capacity=1000, frames=40), Reference()
    envs = FrameEnvs(2, p_end=0.1, shift=False, seed=7)
    for seq in range(20):
        ref.add(ring, decode_fragment(envs.fragment(5, seq=seq)))
    ref.assert_held(ring)
    assert ring.size < 40 // 4 and ring.evicted_early > 0
    assert ring.size + ring.evicted_early == ref.total  # never full: every eviction was an early one


def test_a_fragment_larger_than_the_ring_keeps_its_newest_rows():
    ring, ref = CompactReplay(capacity=5), Reference()
    ref.add(ring, decode_fragment(FrameEnvs(2, seed=8).fragment(4)))
    assert ring.size == 5 and ring.evicted_early == 0
    ref.assert_held(ring)


def test_sampling_matches_replay_ring_rows_dtypes_and_shapes():
    frag = decode_fragment(FrameEnvs(3, seed=9).fragment(6))
    compact, plain = CompactReplay(capacity=64, seed=3), ReplayRing(capacity=64, seed=3)
    compact.add(frag)
    plain.add(frag)
    want, got = plain.sample(50), compact.sample(50)  # same seed, no wrap: the same rows
    assert list(got) == list(want) == DQN_FIELDS
    for name in DQN_FIELDS:
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_mismatched_fragment_is_refused_without_changes():
    ring, ref = CompactReplay(capacity=20), Reference()
    ref.add(ring, decode_fragment(FrameEnvs(2, seed=10).fragment(3)))
    state = ring.state()
    with pytest.raises(TensorError, match="differs from this buffer's") as err:
        ring.add(decode_fragment(FrameEnvs(2, frame=(5, 6), seed=11).fragment(3)))
    assert err.value.field == "obs" and ring.state() == state
    ref.assert_held(ring)


# --- the Store's choice of layout, and the metric ------------------------------------------------------

def store(compact_replay: str = "auto", buffer_size: int = 64, n_step: int = 1) -> Store:
    return Store(config_from_dict({"algorithm": "dqn", "env": {"id": "CartPole-v1", "num_envs": 2},
                                   "dqn": {"buffer_size": buffer_size, "batch_size": 8, "learning_starts": 8,
                                           "rollout_steps": 4, "replay_ratio": 0,  # unpaced: layout only
                                           "n_step": n_step},
                                   "buffer": {"compact_replay": compact_replay}}), Metrics("buffer"))


@pytest.mark.parametrize("mode, msg, layout", [
    ("auto", FrameEnvs(2, seed=1).fragment(4), CompactReplay),
    ("auto", FrameEnvs(2, seed=1, shift=False, p_end=0).fragment(4), ReplayRing),     # e.g. unstacked colour frames
    ("auto", FrameEnvs(2, frame=(6,), seed=1).fragment(4), ReplayRing),              # stacks of vectors
    ("auto", FrameEnvs(2, stack=1, seed=1).fragment(4), ReplayRing),                 # no stack to share
    ("auto", make_msg(4, 2, obs_shape=(4,), algorithm=DQN), ReplayRing),                # CartPole's floats
    ("never", FrameEnvs(2, seed=1).fragment(4), ReplayRing),
    ("always", FrameEnvs(2, frame=(6,), seed=1).fragment(4), CompactReplay),
])
def test_the_store_picks_the_layout_at_the_first_insert(mode, msg, layout):
    s = store(mode)
    assert s.insert(msg) is Outcome.ACCEPTED
    assert type(s.replay) is layout
    assert s.size == 8 and s.next_batch(8, "learner-0") is not None


def test_the_store_counts_early_evictions():
    s = store("always", buffer_size=200)  # frames for 270: stacks that do not shift take 4 each
    envs = FrameEnvs(2, shift=False, seed=12)
    for seq in range(10):
        assert s.insert(envs.fragment(4, seq=seq)) is Outcome.ACCEPTED
    early = s.metrics.counters["buffer/samples_evicted_early_total"]
    assert early == s.replay.evicted_early > 0
    assert s.size + early == 80


def test_compact_replay_setting_is_validated():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"buffer": {"compact_replay": "on"}})
    assert err.value.key == "buffer.compact_replay" and "'auto'" in str(err.value)
    with pytest.raises(ConfigError, match="buffer.compact_replay"):
        config_from_dict({"buffer": {"compact_replay": False}})  # YAML reads a bare `off` as false
    assert config_from_dict({}).buffer.compact_replay == "auto"


# --- checkpoints ----------------------------------------------------------------------------------------

def filled(s: Store, fragments: int = 30) -> Reference:
    ref, actors = Reference(), [FrameEnvs(2, p_end=0.1, seed=20 + a) for a in range(2)]
    for seq in range(fragments):
        msg = actors[seq % 2].fragment(4, actor_id=f"actor-{seq % 2}", seq=seq, incarnation=7, policy_version=seq)
        assert s.insert(msg) is Outcome.ACCEPTED
        ref.parts.append(transitions(decode_fragment(msg)))
    return ref


async def saved_and_restored(s: Store, tmp_path, into: Store) -> Store:
    await BufferCheckpointer(s, s.cfg, tmp_path, s.metrics).save()
    await BufferCheckpointer(into, into.cfg, tmp_path, into.metrics).restore()
    return into


async def test_checkpoint_round_trip_samples_the_same_transitions(tmp_path):
    s = store()
    ref = filled(s)
    s.next_batch(8, "learner-0")
    assert isinstance(s.replay, CompactReplay) and s.size == 64
    again = await saved_and_restored(s, tmp_path, store())
    assert isinstance(again.replay, CompactReplay) and again.replay.state() == s.replay.state()
    ref.assert_held(again.replay)
    for _ in range(3):
        want, got = s.replay.sample(16), again.replay.sample(16)
        for name in DQN_FIELDS:
            np.testing.assert_array_equal(want[name], got[name], err_msg=name)
    # and both go on alike (the restored one starts its chains anew)
    more = FrameEnvs(2, seed=99).fragment(4, actor_id="actor-9", seq=0, incarnation=1)
    s.insert(more)
    again.insert(more)
    np.testing.assert_array_equal(s.replay.sample(64)["obs"], again.replay.sample(64)["obs"])


async def test_checkpoint_restored_into_a_smaller_ring_keeps_the_newest(tmp_path):
    s = store()
    filled(s)
    small = await saved_and_restored(s, tmp_path, store(buffer_size=24))
    assert small.size == 24 and small.replay.num_frames == frame_ring_size(24, 4)[0]
    newest = s.replay.gather(np.arange(64 - 24, 64))
    got = small.replay.gather(np.arange(24))
    for name in DQN_FIELDS:
        np.testing.assert_array_equal(got[name], newest[name], err_msg=name)
    assert small.insert(FrameEnvs(2, seed=5).fragment(4, actor_id="x")) is Outcome.ACCEPTED and small.size == 24


async def test_checkpoint_of_the_other_layout_is_refused_naming_the_setting(tmp_path, caplog):
    s = store()
    filled(s, fragments=4)
    with caplog.at_level(logging.WARNING):
        plain = await saved_and_restored(s, tmp_path, store("never"))
    assert plain.size == 0 and "buffer.compact_replay is 'never'" in caplog.text
    assert plain.insert(FrameEnvs(2, seed=1).fragment(4)) is Outcome.ACCEPTED and type(plain.replay) is ReplayRing


def test_restore_into_a_smaller_frame_ring_keeps_the_newest_whose_frames_fit():
    ring = CompactReplay(capacity=40, frames=400)
    random_stream(1, ring, fragments=40)
    arrays = {k: v[:ring.used()[k]].copy() for k, v in ring.data.items()}
    small = CompactReplay(capacity=40, frames=40)
    small.restore(arrays, ring.state())
    assert 0 < small.size < ring.size and small.evicted_early == ring.size - small.size
    newest, got = ring.gather(np.arange(ring.size - small.size, ring.size)), small.gather(np.arange(small.size))
    for name in DQN_FIELDS:
        np.testing.assert_array_equal(got[name], newest[name], err_msg=name)
    ref, envs = Reference(), FrameEnvs(2, seed=16)  # and it goes on right: no row outlives its frames
    ref.parts.append(got)
    for seq in range(10):
        ref.add(small, decode_fragment(envs.fragment(3, actor_id="new", seq=seq)))
        ref.assert_held(small)


def test_restore_refuses_inconsistent_contents_without_changes():
    ring = CompactReplay(capacity=20)
    Reference().add(ring, decode_fragment(FrameEnvs(2, seed=13).fragment(5)))
    arrays = {k: v[:ring.used()[k]].copy() for k, v in ring.data.items()}
    arrays["obs_frames"][3, 0] = ring.frames_written + 5  # refers to a frame never written
    other = CompactReplay(capacity=20)
    with pytest.raises(ValueError, match="refer to frames"):
        other.restore(arrays, ring.state())
    assert other.data is None and other.size == 0


# --- memory ---------------------------------------------------------------------------------------------

def test_a_million_pong_transitions_fit_in_8_gb():
    """Allocated bytes per transition of a ring of 20,000 Pong transitions ([4, 84, 84] uint8 stacks,
    fragments of 16 steps x 8 envs) filled to capacity, times 1M; np.empty leaves untouched pages
    unallocated, and only 2 fragments are written."""
    ring = CompactReplay(capacity=20_000)
    envs = FrameEnvs(8, frame=(84, 84), p_end=0.0, seed=0)
    for seq in range(2):
        ring.add(decode_fragment(envs.fragment(16, seq=seq)))
    assert ring.frames_written == 8 * 4 + 2 * 128
    per_transition = ring.nbytes() / ring.capacity
    assert per_transition * 1_000_000 < 8e9, per_transition
    plain_per_transition = 2 * 4 * 84 * 84
    assert per_transition < plain_per_transition / 7

"""Session fragments are encoded off the event loop (services/actor/encoder.py): the same content as the
old build_fragment path, in seq order, nothing lost at shutdown, and the loop free while one encodes.

Nothing here asserts on wall-clock time: a slow encode is an encoder blocked on a threading.Event.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest

from kuberl.v1 import actor_pb2
from kuberl.v1 import common_pb2 as pb
from services.actor.encoder import FragmentEncoder
from services.actor.sessions import SessionHub
from services.common.protocol import spaces
from services.common.protocol.fragments import (EncodedFragment, RawFragment, build_fragment, decode_fragment,
                                       encode_fragment, join_releasing_gil)
from services.common.models.nets import EnvSpec
from services.common.protocol.spaces import Discrete, MultiDiscrete
from services.common.stats import Metrics
from services.common.protocol.tensors import encode
from services.config import config_from_dict

T, N = 4, 3
WAIT_S = 30.0  # an upper bound only: nothing here waits this long unless it is broken
IMAGE = EnvSpec((2, 5, 5), np.dtype(np.uint8), Discrete(4))                       # a Box of images
KEYS = spaces.dict_layout({"pos": (2,), "vel": (1,)})
DICT = EnvSpec((3,), np.dtype(np.float32), MultiDiscrete((3, 2)), KEYS)           # a Dict, with action masks


def config(algorithm="ppo", rollout_steps=T):
    return config_from_dict({"algorithm": algorithm, "env": {"mode": "external"},
                             algorithm: {"rollout_steps": rollout_steps}})


def hello(spec: EnvSpec, sid="s", n=N) -> actor_pb2.EnvHello:
    msg = actor_pb2.EnvHello(session_id=sid, num_envs=n)
    if spec.obs_keys is None:
        msg.observation_space.box.shape[:] = spec.obs_shape
        msg.observation_space.box.dtype = pb.DTYPE_UINT8 if spec.obs_dtype == np.uint8 else pb.DTYPE_FLOAT32
    else:
        spaces.dict_layout_to_proto(spec.obs_keys, msg.observation_space.dict)
    spaces.to_proto(spec.action, msg.action_space)
    return msg


def obs_of(spec: EnvSpec, k: int, n=N, salt=0) -> np.ndarray:
    """Step k's observations: every value tells the step, the env and the salt (the session) apart."""
    rng = np.random.default_rng(1000 * salt + k)
    if spec.obs_dtype == np.uint8:
        return rng.integers(0, 256, (n, *spec.obs_shape), np.uint8)
    return rng.normal(size=(n, *spec.obs_shape)).astype(np.float32)


def env_step(spec: EnvSpec, k: int, n=N, salt=0, ended=(), mask=None) -> actor_pb2.EnvStep:
    msg = actor_pb2.EnvStep(step_id=k, observations=encode(obs_of(spec, k, n, salt)))
    if k:
        term = np.isin(np.arange(n), ended)
        msg.rewards.CopyFrom(encode(np.arange(n, dtype=np.float32) + k))
        msg.terminated.CopyFrom(encode(term))
        msg.truncated.CopyFrom(encode(np.zeros(n, bool)))
        if len(ended):
            msg.final_observations.CopyFrom(encode(obs_of(spec, k, n, salt + 7)[term]))
    if mask is not None:
        msg.action_masks.CopyFrom(encode(mask))
    return msg


def actions_for(spec: EnvSpec, k: int, n=N):
    shape = (n, *spec.action.shape)
    return (np.full(shape, k % 2, spec.action.dtype),
            {"behaviour_logprob": -np.arange(n, dtype=np.float32) - k / 10})


def drive(h: SessionHub, s, spec: EnvSpec, steps: int, start=0, salt=0, version=1):
    """Steps start..start+steps of session s; env 1 ends an episode every 3 steps; the Dict session
    sends masks on even steps (the fragment then carries masks)."""
    for k in range(start, start + steps + (start == 0)):
        mask = None
        if spec.action.mask_width and k % 2 == 0:
            mask = np.ones((N, spec.action.mask_width), bool)
            mask[:, 1] = False
        h.observe(s, env_step(spec, k, salt=salt, ended=(1,) if k and k % 3 == 0 else (), mask=mask))
        a, extras = actions_for(spec, k)
        h.record_actions(s, a, extras, version + k)


class Blocked:
    """A fake encoder that blocks on `release` before encoding (for real): a slow encode."""

    def __init__(self):
        self.release, self.started = threading.Event(), threading.Event()
        self.calls = 0

    def __call__(self, **fields) -> EncodedFragment:
        self.calls += 1
        self.started.set()
        assert self.release.wait(WAIT_S)
        return encode_fragment(**fields)


def content(frag) -> dict:
    """Everything a fragment says, but its creation time."""
    f = decode_fragment(frag)
    out = {name: getattr(f, name) for name in ("actor_id", "seq", "policy_version", "incarnation", "algorithm",
                                               "env_ids", "obs", "actions", "rewards", "terminated", "truncated",
                                               "final_obs", "final_index", "action_mask")}
    out.update({f"extras.{k}": v for k, v in f.extras.items()})
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            assert x is not None and y is not None and x.dtype == y.dtype and x.shape == y.shape, name
            np.testing.assert_array_equal(x, y, err_msg=name)
        else:
            assert x == y, name


# -- (a) the same fragments as the build_fragment path -----------------------------------------------
@pytest.mark.parametrize("spec", [IMAGE, DICT], ids=["box-image", "dict-masked"])
async def test_the_encoded_fragments_decode_to_what_build_fragment_made_of_them(spec):
    """Two hubs see the same steps: one encodes on its encoder thread, the other the old way (the message
    built with build_fragment, then serialized). Every fragment decodes to the same content, and the
    payload is byte for byte the old one's (its creation time set alike: each hub stamps its own)."""
    loop = asyncio.get_running_loop()
    new: list[EncodedFragment] = []
    old: list[pb.TrajectoryFragment] = []

    def the_old_way(**fields) -> EncodedFragment:
        fields.pop("created_unix_s")  # (build_fragment stamps its own)
        msg = build_fragment(**fields)
        old.append(msg)
        return EncodedFragment.of(msg)

    hubs = [SessionHub(config(), spec, "actor-e", Metrics("actor"), incarnation=7, encoder=FragmentEncoder(),
                       on_fragment=lambda frag: loop.call_soon_threadsafe(new.append, frag)),
            SessionHub(config(), spec, "actor-e", Metrics("actor"), incarnation=7, on_fragment=lambda frag: None,
                       encoder=FragmentEncoder(encode=the_old_way))]
    for h in hubs:
        s, _ = h.open(hello(spec))
        drive(h, s, spec, steps=2 * T + 2)   # two whole fragments, two steps into the third
        h.close(s, "closed")                 # the third goes out, its running episodes truncated
        s, _ = h.open(hello(spec, "t"))
        drive(h, s, spec, steps=1, salt=3)
        h.open(hello(spec, "t"))             # a takeover flushes the older stream's fragment
    for h in hubs:
        await asyncio.to_thread(h.flush)
    assert [f.seq for f in new] == [m.seq for m in old] == [0, 1, 2, 3]
    for frag, msg in zip(new, old):
        created = RawFragment(frag.payload).created_unix_s
        assert abs(created - msg.created_unix_s) < 600   # stamped when cut (the one thing that differs)
        msg.created_unix_s = created
        assert frag.payload == msg.SerializeToString()
        assert frag.samples == msg.num_steps * len(msg.env_ids)
        assert_same(content(RawFragment(frag.payload)), content(msg))
    # ... and what they hold is what the simulator sent.
    first, partial, took_over = (decode_fragment(RawFragment(new[i].payload), algorithm=pb.ALGORITHM_PPO,
                                                 extras=("behaviour_logprob",)) for i in (0, 2, 3))
    np.testing.assert_array_equal(first.obs, np.stack([obs_of(spec, k) for k in range(T + 1)]))
    np.testing.assert_array_equal(first.extras["behaviour_logprob"][1], actions_for(spec, 1)[1]["behaviour_logprob"])
    assert first.terminated[2].tolist() == [False, True, False]   # step 3 ended env 1's episode
    np.testing.assert_array_equal(first.next_obs()[2, 1], obs_of(spec, 3, salt=7)[1])
    assert first.policy_version == 1 and (first.action_mask is not None) == bool(spec.action.mask_width)
    assert partial.num_steps == 2 and partial.truncated[1].all() and not partial.truncated[0].any()
    assert partial.terminated[0].tolist() == [False, True, False]   # step 9 ended env 1's episode
    np.testing.assert_array_equal(partial.next_obs()[1], obs_of(spec, 2 * T + 2))  # bootstrapped from the last
    assert took_over.num_steps == 1 and list(took_over.env_ids) == [N, N + 1, N + 2]


def test_without_an_encoder_the_fragment_is_encoded_inline_before_the_step_returns():
    out: list[EncodedFragment] = []
    h = SessionHub(config(), IMAGE, "actor-e", Metrics("actor"), out.append)
    s, _ = h.open(hello(IMAGE))
    drive(h, s, IMAGE, steps=T)
    assert [f.seq for f in out] == [0] and h.flush()
    decode_fragment(RawFragment(out[0].payload), algorithm=pb.ALGORITHM_PPO)


# -- (b) seq order -----------------------------------------------------------------------------------
async def test_many_fragments_cut_quickly_reach_the_sink_in_seq_order_each_with_its_own_data():
    """Five sessions cut a fragment at every step (rollout_steps 1), interleaved, while the encoder
    dawdles at random: each fragment is handed over in the order cut, and holds the steps it was cut from."""
    loop = asyncio.get_running_loop()
    got: list[EncodedFragment] = []
    cut: list[tuple[int, int]] = []   # (seq, samples) as each is cut
    rng = random.Random(0)

    def dawdling(**fields) -> EncodedFragment:
        if rng.random() < 0.3:
            time.sleep(rng.random() / 1000)
        return encode_fragment(**fields)

    h = SessionHub(config(rollout_steps=1), IMAGE, "actor-o", Metrics("actor"), encoder=FragmentEncoder(dawdling),
                   on_fragment=lambda frag: loop.call_soon_threadsafe(got.append, frag),
                   on_cut=lambda seq, samples: cut.append((seq, samples)))
    sessions = [h.open(hello(IMAGE, f"s{i}"))[0] for i in range(5)]
    expect: dict[int, tuple[int, int]] = {}   # seq -> (session, step)
    for k in range(40):
        for i, s in enumerate(sessions):
            seq = h.seq
            h.observe(s, env_step(IMAGE, k, salt=i))
            if k:
                expect[seq] = (i, k)
            h.record_actions(s, *actions_for(IMAGE, k), version=k)
        if k % 10 == 0:
            await asyncio.sleep(0)   # let some be handed over meanwhile
    await asyncio.to_thread(h.flush)
    assert [f.seq for f in got] == list(range(len(expect))) == [seq for seq, _ in cut]
    assert all(samples == N for _, samples in cut) and h.metrics.counters["actor/fragments_total"] == len(expect)
    for frag in got:
        i, k = expect[frag.seq]
        f = decode_fragment(RawFragment(frag.payload))
        np.testing.assert_array_equal(f.obs[1], obs_of(IMAGE, k, salt=i))
        np.testing.assert_array_equal(f.obs[0], obs_of(IMAGE, k - 1, salt=i))
        assert f.policy_version == k - 1


def test_the_session_goes_on_in_fresh_arrays_while_its_last_fragment_is_encoded():
    """A whole second fragment is stepped while the first one's encode is blocked: the first holds its
    own steps, never the second's (the loop never writes an array the encoder reads)."""
    slow, out = Blocked(), []
    h = SessionHub(config(), IMAGE, "actor-f", Metrics("actor"), out.append, encoder=FragmentEncoder(slow))
    s, _ = h.open(hello(IMAGE))
    drive(h, s, IMAGE, steps=T)
    assert slow.started.wait(WAIT_S)
    drive(h, s, IMAGE, steps=T - 1, start=T + 1)   # a second fragment, but for its last step
    h.close(s, "closed")
    h.record_actions(s, *actions_for(IMAGE, 99), version=99)   # actions chosen for a session closed meanwhile: dropped
    slow.release.set()
    assert h.flush(WAIT_S)
    first, second = (decode_fragment(RawFragment(f.payload)) for f in out)
    np.testing.assert_array_equal(first.obs, np.stack([obs_of(IMAGE, k) for k in range(T + 1)]))
    np.testing.assert_array_equal(second.obs, np.stack([obs_of(IMAGE, k) for k in range(T, 2 * T)]))
    assert first.actions[:, 0].tolist() == [k % 2 for k in range(T)]
    assert second.actions[:, 0].tolist() == [k % 2 for k in range(T, 2 * T - 1)]  # not the closed one's 99
    assert s.buffers == {} and h.metrics.counters["actor/fragments_total"] == 2


# -- (c) shutdown --------------------------------------------------------------------------------------
async def test_the_shutdown_flush_waits_for_every_pending_encode():
    """What the actor's shutdown does (main.py): close_all, then `await asyncio.to_thread(hub.flush)`
    before the pusher's last drain. With every encode held up, the flush does not return; once they
    go, everything cut is in the queue by the time it has, in seq order: whole fragments and the
    closed sessions' partial ones."""
    loop = asyncio.get_running_loop()
    queued: list[EncodedFragment] = []
    slow = Blocked()
    h = SessionHub(config(), IMAGE, "actor-s", Metrics("actor"), encoder=FragmentEncoder(slow),
                   on_fragment=lambda frag: loop.call_soon_threadsafe(queued.append, frag))
    a, _ = h.open(hello(IMAGE, "a"))
    b, _ = h.open(hello(IMAGE, "b"))
    drive(h, a, IMAGE, steps=2 * T + 1)         # two whole fragments, one step of a third
    drive(h, b, IMAGE, steps=T - 1, salt=1)     # none whole
    h.close_all()                               # the partial ones are cut: 4 in all
    assert h.seq == 4 and not queued
    flush = asyncio.ensure_future(asyncio.to_thread(h.flush))
    assert await asyncio.to_thread(slow.started.wait, WAIT_S)   # the encoder's thread is in the first encode
    assert h.encoder.pending == 4 and not queued and not flush.done()   # held up there: none handed on
    slow.release.set()
    assert await asyncio.wait_for(flush, WAIT_S)
    assert [f.seq for f in queued] == [0, 1, 2, 3]   # all of them, without another turn of the loop
    assert [decode_fragment(RawFragment(f.payload)).num_steps for f in queued] == [T, T, 1, T - 1]
    assert sum(f.samples for f in queued) == (3 * T) * N


def test_closing_a_session_does_not_lose_its_last_fragment_and_the_encoder_ends_its_thread():
    slow, out = Blocked(), []
    encoder = FragmentEncoder(slow, name="test-encoder")
    h = SessionHub(config(), IMAGE, "actor-c", Metrics("actor"), out.append, encoder=encoder)
    s, _ = h.open(hello(IMAGE))
    drive(h, s, IMAGE, steps=2)
    h.close(s, "timeout")
    assert encoder.pending == 1 and not h.flush(timeout=0.01)   # held up: not flushed yet
    slow.release.set()
    assert h.flush(WAIT_S) and encoder.pending == 0
    (frag,) = (decode_fragment(RawFragment(f.payload)) for f in out)
    assert frag.num_steps == 2 and frag.truncated[1].all()
    assert not any(t.name == "test-encoder" for t in threading.enumerate())
    s, _ = h.open(hello(IMAGE, "again"))   # a later fragment starts the thread again
    drive(h, s, IMAGE, steps=T)
    assert h.flush(WAIT_S) and [f.seq for f in out] == [0, 1]


# -- (d) the loop is free ------------------------------------------------------------------------------
async def test_the_loop_runs_other_work_while_a_fragment_is_being_encoded():
    """The step that cuts a fragment returns while its encode is still blocked, and other tasks on the
    loop (another session's reply) run meanwhile; the fragment arrives once the encode is let go."""
    loop = asyncio.get_running_loop()
    slow, got = Blocked(), []
    arrived = asyncio.Event()

    def deliver(frag: EncodedFragment) -> None:
        got.append(frag)
        arrived.set()

    h = SessionHub(config(), IMAGE, "actor-d", Metrics("actor"), encoder=FragmentEncoder(slow),
                   on_fragment=lambda frag: loop.call_soon_threadsafe(deliver, frag))
    s, _ = h.open(hello(IMAGE))
    drive(h, s, IMAGE, steps=T)               # returns: the cut did not wait for the encode
    assert h.seq == 1 and not got
    assert await asyncio.to_thread(slow.started.wait, WAIT_S)

    ticks = 0

    async def other_session() -> None:
        nonlocal ticks
        while True:
            ticks += 1
            await asyncio.sleep(0)

    other = asyncio.create_task(other_session())
    for _ in range(50):
        await asyncio.sleep(0)
    assert ticks >= 40 and not slow.release.is_set() and not got   # ran while the encode was blocked
    slow.release.set()
    await asyncio.wait_for(arrived.wait(), WAIT_S)
    other.cancel()
    assert [f.seq for f in got] == [0]


# -- the encoder and its copy ---------------------------------------------------------------------------
def test_an_encode_that_fails_is_logged_counted_as_dropped_and_the_next_ones_still_go(caplog):
    out, metrics = [], Metrics("actor")

    def flaky(**fields) -> EncodedFragment:
        if fields["seq"] == 1:
            raise RuntimeError("boom")
        return EncodedFragment(fields["seq"], 0, b"")

    encoder = FragmentEncoder(flaky, metrics=metrics)
    for seq in range(3):
        encoder.submit({"seq": seq, "rewards": np.zeros((4, 2), np.float32)}, out.append)
    assert encoder.close(WAIT_S)
    assert [f.seq for f in out] == [0, 2] and "encoding fragment seq 1 failed" in caplog.text
    assert metrics.counters["actor/fragments_dropped_total"] == 1
    assert metrics.counters["actor/samples_dropped_total"] == 8


@pytest.mark.parametrize("parts", [
    [], [b""], [b"a"], [b"head", memoryview(np.arange(1000, dtype=np.float32).view(np.uint8)), b"", b"tail"],
    [memoryview(np.random.default_rng(0).integers(0, 256, 3 << 20, np.uint8)), memoryview(b"")],
])
def test_join_releasing_gil_joins_as_bytes_join_does(parts):
    joined = join_releasing_gil(parts)
    assert type(joined) is bytes and joined == b"".join(parts)


def test_encode_fragment_releasing_the_gil_writes_the_same_bytes():
    h = SessionHub(config(), IMAGE, "actor-g", Metrics("actor"), lambda frag: None)
    fields = {}
    h.encoder = FragmentEncoder(lambda **f: (fields.update(f), EncodedFragment(0, 0, b""))[1])
    s, _ = h.open(hello(IMAGE))
    drive(h, s, IMAGE, steps=T)
    assert h.flush(WAIT_S) and fields
    assert encode_fragment(**fields, release_gil=True).payload == encode_fragment(**fields).payload


def test_submit_waits_while_max_pending_fragments_are_pending():
    """Bounded: an encoder that cannot keep up holds up whoever cuts (as encoding inline did)."""
    slow, out = Blocked(), []
    encoder = FragmentEncoder(slow, max_pending=2)
    fields = {"seq": 0, **fragment_fields()}
    encoder.submit(fields, out.append)
    encoder.submit({**fields, "seq": 1}, out.append)
    third = threading.Event()
    cutter = threading.Thread(target=lambda: (encoder.submit({**fields, "seq": 2}, out.append), third.set()))
    cutter.start()
    assert slow.started.wait(WAIT_S) and not third.wait(0.05) and encoder.pending == 2   # held up
    slow.release.set()
    assert third.wait(WAIT_S) and encoder.close(WAIT_S)
    cutter.join(WAIT_S)
    assert [f.seq for f in out] == [0, 1, 2]


def fragment_fields() -> dict:
    """encode_fragment's arguments for a small valid fragment, but its seq."""
    return {"actor_id": "actor-m", "policy_version": 1, "algorithm": pb.ALGORITHM_PPO, "env_ids": range(N),
            "obs": np.zeros((T + 1, N, 2), np.float32), "actions": np.zeros((T, N), np.int64),
            "rewards": np.zeros((T, N), np.float32), "terminated": np.zeros((T, N), bool),
            "truncated": np.zeros((T, N), bool), "final_obs": np.zeros((0, 2), np.float32),
            "final_index": np.zeros(0, np.int64), "extras": {"behaviour_logprob": np.zeros((T, N), np.float32)}}

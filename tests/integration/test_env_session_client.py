"""External simulators over Actor.EnvSession, end to end: real buffer, learner and an actor in
env.mode external as processes; simulators are kuberl_client sessions (or raw streams) in this process.

The protocol under test is the one documented on the RPC in protos/kuberl/v1/actor.proto. Nothing
here depends on timing except generous upper bounds (every wait is a poll with a deadline).
"""

from __future__ import annotations

import copy
import queue
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import gymnasium as gym
import numpy as np
import pytest

from kuberl.v1 import actor_pb2, actor_pb2_grpc, buffer_pb2_grpc, learner_pb2_grpc
from kuberl.v1 import common_pb2 as pb
from kuberl_client import EnvSessionClient, SessionError, SessionTimeout
from kuberl_client.gym import serve_gym_env
from services.common.protocol.tensors import encode
from tests.helpers import TINY_PPO, Service, stats, wait_for, write_config

OBS_SHAPE = (4,)  # CartPole-v1: Box[4] float32, Discrete(2)
WAIT_S = 120.0    # upper bound for anything to happen on a loaded 2-core machine


def external_config(**actor) -> dict:
    cfg = copy.deepcopy(TINY_PPO)
    cfg["env"] = {"id": "CartPole-v1", "mode": "external"}
    # A send queue deep enough that no fragment is dropped when the pusher falls behind on a loaded
    # machine (tiny fragments of 8 steps): the tests count every sample at the buffer.
    cfg["actor"].update({"queue_fragments": 8192, **actor})
    return cfg


class Stack:
    """Buffer, learner and an external-mode actor as processes."""

    def __init__(self, tmp_path, cfg: dict):
        config = write_config(tmp_path / "c.yaml", cfg)
        self.procs: list[Service] = []
        try:
            self.buffer = self._start(Service("buffer", tmp_path, config))
            self.learner = self._start(Service("learner", tmp_path, config, "--buffer", self.buffer,
                                               "--checkpoint-dir", str(tmp_path / "ck")))
            self.actor = self._start(Service("actor", tmp_path, config, "--buffer", self.buffer,
                                             "--learner", self.learner))
        except BaseException:
            self.close()
            raise

    def _start(self, service: Service) -> str:
        self.procs.append(service)
        return service.wait_ready(timeout=3 * WAIT_S)

    def actor_stats(self) -> dict:
        return stats(self.actor, actor_pb2_grpc.ActorStub, timeout=30)

    def buffer_stats(self) -> dict:
        return stats(self.buffer, buffer_pb2_grpc.BufferStub, timeout=30)

    def learner_stats(self) -> dict:
        return stats(self.learner, learner_pb2_grpc.LearnerStub, timeout=30)

    def episodes(self, after: int = 0) -> list[pb.Episode]:
        with grpc.insecure_channel(self.actor) as ch:
            return list(actor_pb2_grpc.ActorStub(ch).GetStats(pb.GetStatsRequest(episodes_after=after),
                                                               timeout=30).episodes)

    def close(self) -> None:
        for p in self.procs:
            p.kill()


@pytest.fixture
def stack(tmp_path):
    s = Stack(tmp_path, external_config())
    yield s
    s.close()


def client(address: str, session_id: str, num_envs: int = 1, **kw) -> EnvSessionClient:
    kw = {"obs_shape": OBS_SHAPE, "obs_dtype": "float32", "num_actions": 2, "timeout_s": WAIT_S, **kw}
    return EnvSessionClient(address, session_id=session_id, num_envs=num_envs, **kw)


def obs(rng, n: int = 1, shape=OBS_SHAPE, dtype=np.float32) -> np.ndarray:
    return rng.normal(size=(n, *shape)).astype(dtype)


def hello_msg(session_id: str, num_envs: int = 1, shape=OBS_SHAPE, dtype=pb.DTYPE_FLOAT32, n: int = 2):
    h = actor_pb2.EnvHello(session_id=session_id, num_envs=num_envs, simulator="test-raw")
    h.observation_space.box.shape[:] = shape
    h.observation_space.box.dtype = dtype
    h.action_space.discrete.n = n
    return actor_pb2.EnvMessage(hello=h)


def step_msg(step_id: int, observations, rewards=None, terminated=None, truncated=None, final=None):
    s = actor_pb2.EnvStep(step_id=step_id)
    encode(observations, s.observations)
    for name, value in (("rewards", rewards), ("terminated", terminated), ("truncated", truncated),
                        ("final_observations", final)):
        if value is not None:
            encode(value, getattr(s, name))
    return actor_pb2.EnvMessage(step=s)


class RawSession:
    """A bare EnvSession stream, for messages the client would never send (and for silence)."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.requests: queue.Queue = queue.Queue()
        self.done = threading.Event()
        self.timed_out = False

        def gen():
            while not self.done.is_set():
                try:
                    item = self.requests.get(timeout=0.5)
                except queue.Empty:
                    continue
                if item is None:
                    return
                yield item

        self.call = actor_pb2_grpc.ActorStub(self.channel).EnvSession(gen(), wait_for_ready=True)

    def send(self, msg) -> None:
        self.requests.put(msg)

    def _expire(self) -> None:
        self.timed_out = True
        self.call.cancel()

    def recv(self, timeout: float = WAIT_S):
        timer = threading.Timer(timeout, self._expire)
        timer.start()
        try:
            return next(self.call)
        finally:
            timer.cancel()

    def status(self, timeout: float = WAIT_S) -> tuple[str, str]:
        """Read until the stream ends; (code name, details) of its final status."""
        try:
            while True:
                msg = self.recv(timeout)
                assert msg.WhichOneof("kind") is not None
        except StopIteration:
            return "OK", ""
        except grpc.RpcError as e:
            assert not self.timed_out, f"the stream did not end within {timeout} s"
            return e.code().name, e.details() or ""

    def close(self) -> None:
        self.done.set()
        self.requests.put(None)
        self.call.cancel()
        self.channel.close()


# -- (a) one session end to end --------------------------------------------------------------------
def test_session_end_to_end_reports_episodes_and_feeds_the_buffer(stack):
    rng = np.random.default_rng(0)
    n, steps = 2, 10
    # env 0: reward 1 per step, terminated after step 3; then reward 2, terminated after step 7.
    # env 1: reward 0.5 per step, truncated after step 5; then runs on to the end.
    expected = [(3.0, 3), (2.5, 5), (8.0, 4)]  # (return, length), in the order they end
    with client(stack.actor, "sim-a", num_envs=n) as c:
        actions = c.reset(obs(rng, n))
        # Nothing was trained on yet (this session is the only producer): the learner's first weights.
        assert c.resumed is False and c.policy_version == 0 and c.session_timeout_s > 0
        for t in range(1, steps + 1):
            assert actions.dtype == np.int64 and actions.shape == (n,) and set(actions) <= {0, 1}
            assert c.step_id == t - 1
            rewards = np.array([1.0 if t <= 3 else 2.0, 0.5], np.float32)
            term = np.array([t in (3, 7), False])
            trunc = np.array([False, t == 5])
            done = term | trunc
            final = obs(rng, int(done.sum())) if done.any() else None
            actions = c.step(obs(rng, n), rewards, term, trunc, final)
    got = [(e.episode_return, e.length) for e in stack.episodes()]
    assert got == expected
    # All 10 x 2 transitions reach the buffer (one full fragment of rollout_steps 8, then the rest
    # flushed at the half-close), and every fragment is valid.
    wait_for(lambda: stack.buffer_stats().get("buffer/samples_received_total", 0) >= steps * n,
             timeout=WAIT_S, what="the session's samples reaching the buffer")
    b = stack.buffer_stats()
    assert b["buffer/samples_received_total"] == steps * n
    assert b["buffer/fragments_received_total"] == 2
    assert b.get("buffer/fragments_invalid_total", 0) == 0
    a = stack.actor_stats()
    assert a["actor/env_steps_total"] == steps * n and a["actor/episodes_total"] == 3


# -- (b) a gymnasium env trains through serve_gym_env ---------------------------------------------
@pytest.mark.timeout(600)
def test_serve_gym_env_trains_cartpole(stack):
    vec = gym.make_vec("CartPole-v1", num_envs=4, vectorization_mode="sync",
                       vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})
    single = gym.make("CartPole-v1")  # a plain Env: wrapped as num_envs=1
    try:
        with ThreadPoolExecutor(2) as pool:
            fv = pool.submit(serve_gym_env, vec, stack.actor, session_id="vec", max_steps=1000, seed=1,
                             timeout_s=WAIT_S, reconnect_s=None)
            fs = pool.submit(serve_gym_env, single, stack.actor, session_id="single", max_steps=2000, seed=2,
                             timeout_s=WAIT_S, reconnect_s=None)
            rv, rs = fv.result(), fs.result()
    finally:
        vec.close()
        single.close()
    assert (rv["steps"], rv["env_steps"], rs["steps"], rs["env_steps"]) == (1000, 4000, 2000, 2000)
    assert rv["episodes"] > 0 and rs["episodes"] > 0
    assert rv["sessions"] == rs["sessions"] == 1
    # The actor saw exactly the episodes the simulators finished (CartPole: return == length).
    local = sorted(zip(rv["returns"] + rs["returns"], rv["lengths"] + rs["lengths"]))
    assert sorted((e.episode_return, e.length) for e in stack.episodes()) == local
    assert stack.actor_stats()["actor/env_steps_total"] == 6000
    wait_for(lambda: stack.buffer_stats().get("buffer/samples_received_total", 0) >= 6000, timeout=WAIT_S,
             what="every sample reaching the buffer")
    assert stack.buffer_stats().get("buffer/fragments_invalid_total", 0) == 0
    wait_for(lambda: stack.learner_stats().get("learner/updates_total", 0) >= 10, timeout=WAIT_S,
             what="the learner training on the simulators' data")


def test_serve_gym_env_hands_over_streams_without_losing_episodes(stack):
    """reconnect_s=0 opens a new stream (same session_id: resumed) after every step."""
    env = gym.make("CartPole-v1")
    try:
        r = serve_gym_env(env, stack.actor, session_id="hand-over", max_steps=120, seed=3, reconnect_s=0.0,
                          timeout_s=WAIT_S)
    finally:
        env.close()
    assert r["steps"] == 120 and r["sessions"] == 121 and r["episodes"] > 0
    assert sorted((e.episode_return, e.length) for e in stack.episodes()) == sorted(zip(r["returns"], r["lengths"]))
    a = stack.actor_stats()
    assert a["actor/env_steps_total"] == 120
    assert a["actor/sessions_resumed_total"] == 120


# -- (c) refusals --------------------------------------------------------------------------------
HELLO_REFUSALS = [  # (client overrides, the space the error must name, words it must contain)
    ({"obs_shape": (5,)}, "observation_space", ("4", "5")),
    ({"obs_shape": (2, 2)}, "observation_space", ("4", "2")),
    ({"obs_dtype": "float64"}, "observation_space", ("float32", "float64")),
    ({"obs_dtype": "uint8"}, "observation_space", ("float32", "uint8")),
    ({"num_actions": 3}, "action_space", ("2", "3")),
    ({"num_actions": 1}, "action_space", ("2", "1")),
    ({"num_actions": 0}, "action_space", ("2", "0")),
]


def test_hello_with_other_spaces_is_refused_naming_the_space(stack):
    failures = []
    for i, (kw, space, words) in enumerate(HELLO_REFUSALS):
        c = client(stack.actor, f"wrong-space-{i}", **kw)
        shape, dtype = kw.get("obs_shape", OBS_SHAPE), kw.get("obs_dtype", "float32")
        try:
            c.reset(np.zeros((1, *shape), dtype))
            failures.append(f"{kw}: accepted")
        except SessionError as e:
            if e.code != "INVALID_ARGUMENT" or space not in e.details or not all(w in e.details for w in words):
                failures.append(f"{kw}: got {e.code} {e.details!r}, expected INVALID_ARGUMENT naming {space} "
                                f"and {words}")
        finally:
            c.cancel()
    # Spaces the client cannot even declare: a Box action space, a Discrete observation space, none.
    odd = [("action_space", lambda h: h.hello.action_space.box.shape.append(2)),
           ("observation_space", lambda h: h.hello.observation_space.discrete.SetInParent()),
           ("observation_space", lambda h: h.hello.ClearField("observation_space")),
           ("observation_space", lambda h: setattr(h.hello.observation_space.box, "dtype", 0)),
           ("num_envs", lambda h: setattr(h.hello, "num_envs", 0)),
           ("num_envs", lambda h: setattr(h.hello, "num_envs", 1025)),
           ("session_id", lambda h: setattr(h.hello, "session_id", "")),
           ("session_id", lambda h: setattr(h.hello, "session_id", "x" * 129))]
    for i, (field, mutate) in enumerate(odd):
        hello = hello_msg(f"odd-{i}")
        mutate(hello)
        raw = RawSession(stack.actor)
        try:
            raw.send(hello)
            code, details = raw.status()
        finally:
            raw.close()
        if code != "INVALID_ARGUMENT" or field not in details:
            failures.append(f"hello {i} ({field}): got {code} {details!r}, expected INVALID_ARGUMENT naming {field}")
    assert not failures, "\n".join(failures)
    # The actor is unaffected: a correct session works right after.
    with client(stack.actor, "right-space") as ok:
        ok.reset(np.zeros((1, 4), np.float32))
        ok.step(np.zeros((1, 4), np.float32), [1.0], [False], [False])
    assert stack.actor_stats()["actor/sessions_total"] == 1


def _bad_steps(n: int = 2):
    """(name, message, expected code, word the error must name): each after a good step 0."""
    o = np.zeros((n, 4), np.float32)
    r, f = np.ones(n, np.float32), np.zeros(n, bool)
    short = step_msg(1, o, r, f, f)
    short.step.observations.data = short.step.observations.data[:-4]  # byte length != shape
    bad_dtype = step_msg(1, o, r, f, f)
    bad_dtype.step.observations.dtype = 42
    neg = step_msg(1, o, r, f, f)
    neg.step.rewards.shape[:] = [-n]
    term = np.array([True] + [False] * (n - 1))
    return [
        ("truncated observation bytes", short, "INVALID_ARGUMENT", "observations"),
        ("unknown dtype code", bad_dtype, "INVALID_ARGUMENT", "observations"),
        ("negative dimension", neg, "INVALID_ARGUMENT", "rewards"),
        ("observations of another dtype", step_msg(1, o.astype(np.float64), r, f, f), "INVALID_ARGUMENT",
         "observations"),
        ("observations of another shape", step_msg(1, np.zeros((n, 5), np.float32), r, f, f), "INVALID_ARGUMENT",
         "observations"),
        ("rewards of another length", step_msg(1, o, np.ones(n + 1, np.float32), f, f), "INVALID_ARGUMENT",
         "rewards"),
        ("flags as float", step_msg(1, o, r, f.astype(np.float32), f), "INVALID_ARGUMENT", "terminated"),
        ("missing rewards", step_msg(1, o, None, f, f), "INVALID_ARGUMENT", "rewards"),
        ("an ended env without final_observations", step_msg(1, o, r, term, f), "INVALID_ARGUMENT",
         "final_observations"),
        ("final_observations of the wrong count", step_msg(1, o, r, term, f, np.zeros((2, 4), np.float32)),
         "INVALID_ARGUMENT", "final_observations"),
        ("final_observations with no env ended", step_msg(1, o, r, f, f, np.zeros((1, 4), np.float32)),
         "INVALID_ARGUMENT", "final_observations"),
        ("step_id out of order", step_msg(2, o, r, f, f), "FAILED_PRECONDITION", None),
        ("a step_id repeated", step_msg(0, o), "FAILED_PRECONDITION", None),
        ("a second hello", hello_msg("x", num_envs=n), "FAILED_PRECONDITION", None),
    ]


def _good_session(address: str, session_id: str, n: int, rng, finished: threading.Event, progress: dict,
                  after: int) -> None:
    """A well-behaved session beside bad ones: steps until `finished`, then `after` more steps (it is
    still served once every bad session has ended), counting them in progress["steps"]."""
    with client(address, session_id, num_envs=n) as c:
        c.reset(obs(rng, n))
        while not finished.is_set():
            c.step(obs(rng, n), np.ones(n, np.float32), np.zeros(n, bool), np.zeros(n, bool))
            progress["steps"] += 1
        for _ in range(after):
            c.step(obs(rng, n), np.ones(n, np.float32), np.zeros(n, bool), np.zeros(n, bool))
            progress["steps"] += 1


def test_malformed_steps_end_only_their_own_session(stack):
    """Each malformed step gets its documented error; a concurrent good session keeps stepping."""
    rng = np.random.default_rng(1)
    finished = threading.Event()
    progress = {"steps": 0}

    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(_good_session, stack.actor, "good", 3, rng, finished, progress, 50)
        try:
            wait_for(lambda: progress["steps"] >= 5 or good.done(), timeout=WAIT_S, what="the good session")
            failures = []
            for i, (what, bad, want_code, word) in enumerate(_bad_steps()):
                raw = RawSession(stack.actor)
                try:
                    raw.send(hello_msg(f"bad-{i}", num_envs=2))
                    assert raw.recv().WhichOneof("kind") == "accepted"
                    raw.send(step_msg(0, np.zeros((2, 4), np.float32)))
                    assert raw.recv().actions.step_id == 0
                    raw.send(bad)
                    code, details = raw.status()
                finally:
                    raw.close()
                if code != want_code or (word is not None and word not in details):
                    failures.append(f"{what}: got {code} {details!r}, expected {want_code} naming {word!r}")
        finally:
            finished.set()
        good.result(timeout=WAIT_S)
    assert not failures, "\n".join(failures)
    assert stack.buffer_stats().get("buffer/fragments_invalid_total", 0) == 0


def test_nan_or_infinity_ends_only_its_own_session_naming_the_field_and_env(stack):
    """A simulator's NaN or infinite observation, reward or final observation gets INVALID_ARGUMENT naming
    the field and the env copy; a concurrent session on the same actor keeps getting actions."""
    rng = np.random.default_rng(2)
    finished = threading.Event()
    progress = {"steps": 0}

    def poisoned(what: str) -> tuple:
        o, r, f, final = np.zeros((3, 4), np.float32), np.ones(3, np.float32), np.zeros(3, bool), None
        if what == "obs":
            o[2, 1] = np.nan
        elif what == "reward":
            r[1] = np.inf
        else:
            f = np.array([False, True, False])
            final = np.full((1, 4), -np.inf, np.float32)
        return o, r, f, np.zeros(3, bool), final

    expected = {"obs": "step 2: observations[1] of env 2 is nan", "reward": "step 2: rewards of env 1 is inf",
                "final": "step 2: final_observations[0] of env 1 is -inf"}
    with ThreadPoolExecutor(1) as pool:
        good = pool.submit(_good_session, stack.actor, "good-nan", 2, rng, finished, progress, 20)
        try:
            wait_for(lambda: progress["steps"] >= 5 or good.done(), timeout=WAIT_S, what="the good session")
            got = {}
            for what in expected:
                with pytest.raises(SessionError) as err:
                    with client(stack.actor, f"nan-{what}", num_envs=3) as c:
                        c.reset(np.zeros((3, 4), np.float32))
                        c.step(np.zeros((3, 4), np.float32), np.ones(3, np.float32), np.zeros(3, bool),
                               np.zeros(3, bool))
                        c.step(*poisoned(what))
                got[what] = (err.value.code, err.value.details)
            steps_then = progress["steps"]
            wait_for(lambda: progress["steps"] > steps_then or good.done(), timeout=WAIT_S,
                     what="the good session to step on")
        finally:
            finished.set()
        good.result(timeout=WAIT_S)
    for what, text in expected.items():
        assert got[what][0] == "INVALID_ARGUMENT" and got[what][1].startswith(text), (what, got[what])
    a = stack.actor_stats()
    assert a["actor/steps_refused_nonfinite_total"] == 3 and a["actor/sessions_total"] == 4, a


def test_step_before_hello_is_refused(stack):
    raw = RawSession(stack.actor)
    try:
        raw.send(step_msg(0, np.zeros((1, 4), np.float32)))
        code, details = raw.status()
    finally:
        raw.close()
    assert code == "FAILED_PRECONDITION", (code, details)


def test_local_mode_actor_refuses_sessions(tmp_path):
    s = Stack(tmp_path, TINY_PPO)
    try:
        c = client(s.actor, "nope")
        with pytest.raises(SessionError) as err:
            c.reset(np.zeros((1, 4), np.float32))
        c.cancel()
        assert err.value.code == "FAILED_PRECONDITION", err.value
    finally:
        s.close()


def test_max_sessions_is_enforced(tmp_path):
    s = Stack(tmp_path, external_config(max_sessions=2))
    try:
        held = [client(s.actor, f"held-{i}") for i in range(2)]
        for c in held:
            c.reset(np.zeros((1, 4), np.float32))
        extra = client(s.actor, "extra")
        with pytest.raises(SessionError) as err:
            extra.reset(np.zeros((1, 4), np.float32))
        extra.cancel()
        assert err.value.code == "RESOURCE_EXHAUSTED", err.value
        for c in held:
            c.close()
    finally:
        s.close()


# -- (d) a silent session times out and its data is kept ----------------------------------------
def test_silent_session_is_closed_with_deadline_exceeded_and_its_data_reaches_the_buffer(tmp_path):
    s = Stack(tmp_path, external_config(session_timeout_s=1.0))
    try:
        rng = np.random.default_rng(2)
        raw = RawSession(s.actor)
        try:
            raw.send(hello_msg("silent"))
            accepted = raw.recv().accepted
            assert accepted.session_id == "silent" and accepted.session_timeout_ms == 1000
            raw.send(step_msg(0, obs(rng)))
            assert raw.recv().actions.step_id == 0
            steps = 5  # fewer than rollout_steps (8): no fragment is cut before the session ends
            for t in range(1, steps + 1):
                f = np.zeros(1, bool)
                raw.send(step_msg(t, obs(rng), np.ones(1, np.float32), f, f))
                assert raw.recv().actions.step_id == t
            code, details = raw.status()  # ... and now silence
        finally:
            raw.close()
        assert code == "DEADLINE_EXCEEDED", (code, details)
        wait_for(lambda: s.buffer_stats().get("buffer/samples_received_total", 0) >= steps, timeout=WAIT_S,
                 what="the silent session's fragment reaching the buffer")
        b = s.buffer_stats()
        assert b["buffer/samples_received_total"] == steps and b["buffer/fragments_received_total"] == 1
        assert b.get("buffer/fragments_invalid_total", 0) == 0
        # The client raises the actor's DEADLINE_EXCEEDED as a SessionError (not its own timeout).
        c = client(s.actor, "silent-client")
        c.reset(obs(rng))
        with pytest.raises(SessionError) as err:
            c._receive("nothing: the test stays silent")  # waits without sending anything
        assert err.value.code == "DEADLINE_EXCEEDED" and not isinstance(err.value, SessionTimeout)
    finally:
        s.close()


def test_an_actor_stopped_mid_fragment_pushes_its_open_sessions_fragments_before_it_exits(tmp_path):
    """SIGTERM while two sessions are open: a whole fragment and both unfinished ones are cut at
    shutdown, encoded off the event loop, and the last drain waits for them: all reach the buffer."""
    s = Stack(tmp_path, external_config())
    raws = [RawSession(s.actor) for _ in range(2)]
    try:
        rng = np.random.default_rng(3)
        f = np.zeros(2, bool)
        for i, (raw, steps) in enumerate(zip(raws, (8 + 3, 5))):   # rollout_steps is 8
            raw.send(hello_msg(f"open-{i}", num_envs=2))
            assert raw.recv().accepted.session_id == f"open-{i}"
            for t in range(steps + 1):
                raw.send(step_msg(t, obs(rng, 2)) if t == 0 else step_msg(t, obs(rng, 2), np.ones(2, np.float32), f, f))
                assert raw.recv().actions.step_id == t
        actor = s.procs[-1]
        assert actor.terminate() == 0
    finally:
        for raw in raws:
            raw.close()
    try:
        wait_for(lambda: s.buffer_stats().get("buffer/samples_received_total", 0) >= (11 + 5) * 2, timeout=WAIT_S,
                 what="the sessions' fragments reaching the buffer")
        b = s.buffer_stats()
        assert b["buffer/samples_received_total"] == (11 + 5) * 2 and b["buffer/fragments_received_total"] == 3
        assert "3 fragments cut, 3 acknowledged, 0 dropped" in actor.output()
    finally:
        s.close()


def test_client_times_out_on_its_own_when_the_actor_does_not_answer():
    """A listening socket that never speaks gRPC: every wait of the client is bounded."""
    import socket
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        c = EnvSessionClient(f"127.0.0.1:{srv.getsockname()[1]}", session_id="x", obs_shape=(4,),
                             obs_dtype="float32", num_actions=2, num_envs=1, timeout_s=1.0)
        with pytest.raises(SessionTimeout) as err:
            c.reset(np.zeros((1, 4), np.float32))
        assert err.value.code == "DEADLINE_EXCEEDED"


# -- (e) an abrupt disconnect, then a resume ----------------------------------------------------------
def test_abrupt_disconnect_leaves_others_alone_and_the_same_id_resumes(stack):
    rng = np.random.default_rng(3)
    stop_other = threading.Event()
    other_steps = {"n": 0}

    def other():  # never ends an episode, so the feed holds only the resumed session's episode
        with client(stack.actor, "bystander", num_envs=2) as c:
            c.reset(obs(rng, 2))
            while not stop_other.is_set() or other_steps["n"] < 20:
                c.step(obs(rng, 2), np.zeros(2, np.float32), np.zeros(2, bool), np.zeros(2, bool))
                other_steps["n"] += 1

    with ThreadPoolExecutor(1) as pool:
        bystander = pool.submit(other)
        try:
            wait_for(lambda: other_steps["n"] >= 3 or bystander.done(), timeout=WAIT_S, what="the bystander")
            first = client(stack.actor, "flaky")
            first.reset(obs(rng))
            assert first.resumed is False
            for _ in range(7):
                first.step(obs(rng), [1.0], [False], [False])
            first.cancel()  # mid-episode, no half-close: the actor sees the stream break
            # The actor notices the broken stream; the bystander keeps stepping meanwhile.
            before = other_steps["n"]
            wait_for(lambda: stack.actor_stats().get("actor/sessions_active") == 1, timeout=WAIT_S,
                     what="the actor closing the broken session")
            wait_for(lambda: other_steps["n"] > before + 5 or bystander.done(), timeout=WAIT_S,
                     what="the bystander stepping on")
            with client(stack.actor, "flaky") as again:
                again.reset(obs(rng))
                assert again.resumed is True
                for t in range(3):
                    again.step(obs(rng), [1.0], [t == 2], [False], obs(rng) if t == 2 else None)
        finally:
            stop_other.set()
        bystander.result(timeout=WAIT_S)
    # The episode's return kept accumulating across the reconnect: 7 + 3 rewards of 1.
    assert [(e.episode_return, e.length) for e in stack.episodes()] == [(10.0, 10)]
    a = stack.actor_stats()
    assert a["actor/sessions_resumed_total"] == 1
    wait_for(lambda: stack.buffer_stats().get("buffer/samples_received_total", 0) == a["actor/env_steps_total"],
             timeout=WAIT_S, what="every transition (the broken session's too) reaching the buffer")
    assert stack.buffer_stats().get("buffer/fragments_invalid_total", 0) == 0


# -- (f) many sessions at once ---------------------------------------------------------------------
@pytest.mark.timeout(900)
def test_64_concurrent_sessions_all_complete(stack):
    sessions, steps = 64, 300
    start = threading.Barrier(sessions, timeout=WAIT_S)

    def run(i: int) -> dict:
        env = gym.make("CartPole-v1")
        try:
            start.wait()
            return serve_gym_env(env, stack.actor, session_id=f"many-{i}", max_steps=steps, seed=i,
                                 timeout_s=WAIT_S * 2)
        finally:
            env.close()

    with ThreadPoolExecutor(sessions) as pool:
        results = list(pool.map(run, range(sessions)))
    assert [r["steps"] for r in results] == [steps] * sessions
    a = stack.actor_stats()
    assert a["actor/env_steps_total"] == sessions * steps
    assert a.get("actor/sessions_refused_total", 0) == 0
    local = sorted((ret, n) for r in results for ret, n in zip(r["returns"], r["lengths"]))
    assert sorted((e.episode_return, e.length) for e in stack.episodes()) == local
    wait_for(lambda: stack.buffer_stats().get("buffer/samples_received_total", 0) >= sessions * steps,
             timeout=WAIT_S, what="every sample reaching the buffer")
    assert stack.buffer_stats().get("buffer/fragments_invalid_total", 0) == 0
    assert stack.actor_stats().get("actor/fragments_dropped_total", 0) == 0

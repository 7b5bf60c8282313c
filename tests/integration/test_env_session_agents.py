"""Sessions of several agents over Actor.EnvSession, end to end (hello.agent_ids): real buffer, learner and
an external-mode actor as processes; the simulator is a kuberl_client session (or a raw stream) here.
Agents join, end, leave and come back; every agent step reaches the buffer; misuse ends only its own
session, with INVALID_ARGUMENT naming the agent and the field."""

from __future__ import annotations

import numpy as np
import pytest

from kuberl.v1 import actor_pb2
from kuberl_client import EnvSessionClient
from services.common.protocol.tensors import encode
from tests.helpers import wait_for
from tests.integration.test_env_session_client import OBS_SHAPE, WAIT_S, RawSession, Stack, external_config, hello_msg

AGENTS = ["car-0", "car-1", "car-2"]


@pytest.fixture
def stack(tmp_path):
    s = Stack(tmp_path, external_config())
    yield s
    s.close()


def agents_client(address: str, session_id: str) -> EnvSessionClient:
    return EnvSessionClient(address, session_id=session_id, agent_ids=AGENTS, obs_shape=OBS_SHAPE,
                            num_actions=2, timeout_s=WAIT_S)


def test_agents_that_join_leave_and_come_back_have_every_step_stored(stack):
    """car-0 acts throughout, its episodes 10 steps long (it acts on with the next); car-1 joins at
    step 5 and leaves at its end at step 12; car-2 acts from the start, ends at step 20, leaves, and
    joins again at step 25. 40 steps, then the session closes."""
    rng = np.random.default_rng(0)
    steps, recorded, ends = 40, 0, []
    with agents_client(stack.actor, "crossing-1") as c:
        acting = ["car-0", "car-2"]
        actions = c.reset({a: rng.normal(size=OBS_SHAPE) for a in acting})
        assert set(actions) == set(acting) and all(a in (0, 1) for a in actions.values())
        for k in range(1, steps + 1):
            term = {a: (a == "car-0" and k % 10 == 0) or (a == "car-1" and k == 12) or (a == "car-2" and k == 20)
                    for a in acting}
            final = {a: rng.normal(size=OBS_SHAPE) for a, t in term.items() if t}
            ends += [a for a, t in term.items() if t]
            nxt = [a for a in acting if a == "car-0" or not term[a]]
            joined = []
            if k == 5:
                nxt.append("car-1")
            if k == 25:
                nxt.append("car-2")
                joined.append("car-2")
            recorded += len(acting)
            actions = c.step({a: rng.normal(size=OBS_SHAPE) for a in nxt}, rewards=dict.fromkeys(acting, 1.0),
                             terminated=term, truncated=dict.fromkeys(acting, False), final_observations=final,
                             joined=joined)
            assert list(actions) == nxt
            acting = nxt
        with pytest.raises(ValueError, match="'car-1' left after its episode ended; list it in joined"):
            c.step({a: rng.normal(size=OBS_SHAPE) for a in [*acting, "car-1"]}, rewards=dict.fromkeys(acting, 1.0),
                   terminated=dict.fromkeys(acting, False), truncated=dict.fromkeys(acting, False))
    assert recorded == 2 * 5 + 3 * (12 - 5) + 2 * (20 - 12) + (25 - 20) + 2 * (40 - 25)
    # Every agent step, recorded once: the actor counted them, and the buffer stored them all.
    wait_for(lambda: stack.buffer_stats().get("buffer/samples_received_total", 0) >= recorded,
             timeout=WAIT_S, what=f"{recorded} samples at the buffer")
    assert stack.buffer_stats()["buffer/samples_received_total"] == recorded
    assert stack.actor_stats()["actor/env_steps_total"] == recorded
    # Each episode that ended is reported once, with its agent's return (1 per step).
    episodes = stack.episodes()
    assert len(episodes) == len(ends) == 4 + 1 + 1
    assert sorted(e.length for e in episodes) == sorted([10, 10, 10, 10, 7, 20])
    assert all(e.episode_return == e.length for e in episodes)


def test_steps_of_no_agents_go_through_the_actor_and_record_nothing(stack):
    """A step on which no agent acts (EnvStep.no_agents; the client's observations {}): both cars end,
    no agent acts for 3 steps (the actor answers {} and records nothing), then car-1 comes back
    (joined) and car-2 comes for the first time. Every agent step reaches the buffer once."""
    rng = np.random.default_rng(2)
    obs = lambda: rng.normal(size=OBS_SHAPE)   # noqa: E731
    calm = {"rewards": {"car-0": 1.0}, "terminated": {"car-0": False}, "truncated": {"car-0": False}}
    with agents_client(stack.actor, "prey-1") as c:
        c.reset({"car-0": obs(), "car-1": obs()})
        c.step({"car-0": obs()}, rewards={"car-0": 1.0, "car-1": 1.0}, terminated={"car-0": False, "car-1": True},
               truncated={"car-0": False, "car-1": False}, final_observations={"car-1": obs()})
        with pytest.raises(ValueError, match="'car-0' acted on the step before and did not end, so it must act"):
            c.step({}, **calm)
        assert c.step({}, rewards={"car-0": 1.0}, terminated={"car-0": True}, truncated={"car-0": False},
                      final_observations={"car-0": obs()}) == {}
        assert c.step({}) == {} and c.step({}) == {}
        with pytest.raises(ValueError, match="'car-2' must not be joined on its first step"):
            c.step({"car-2": obs()}, joined=["car-2"])
        actions = c.step({"car-1": obs(), "car-2": obs()}, joined=["car-1"])
        assert list(actions) == ["car-1", "car-2"] and c.step_id == 5
        for _ in range(3):
            c.step({"car-1": obs(), "car-2": obs()}, rewards={"car-1": 1.0, "car-2": 1.0},
                   terminated={"car-1": False, "car-2": False}, truncated={"car-1": False, "car-2": False})
    recorded = 2 + 1 + 2 * 3   # steps 0 and 1 (car-1 ends), 1 (car-0 ends), 5..8
    wait_for(lambda: stack.buffer_stats().get("buffer/samples_received_total", 0) >= recorded,
             timeout=WAIT_S, what=f"{recorded} samples at the buffer")
    assert stack.buffer_stats()["buffer/samples_received_total"] == recorded
    assert stack.actor_stats()["actor/env_steps_total"] == recorded
    assert sorted(e.length for e in stack.episodes()) == [1, 2]


def _agents_hello(session_id: str, ids=AGENTS):
    msg = hello_msg(session_id, num_envs=0)
    msg.hello.agent_ids.extend(ids)
    return msg


def _step(k: int, agents: list[str], rows: int, acted: int = 0, joined=()):
    s = actor_pb2.EnvStep(step_id=k, agents=agents, joined=joined)
    encode(np.zeros((rows, *OBS_SHAPE), np.float32), s.observations)
    if k:
        encode(np.zeros(acted, np.float32), s.rewards)
        encode(np.zeros(acted, bool), s.terminated)
        encode(np.zeros(acted, bool), s.truncated)
    return actor_pb2.EnvMessage(step=s)


@pytest.mark.parametrize("second,message", [
    (_step(1, ["car-0", "bus-9"], 2, acted=2), "step 1: agents[1]: 'bus-9' is not one of hello.agent_ids"),
    (_step(1, ["car-0"], 1, acted=2), "step 1: agents: 'car-1' acted on step 0 and did not end, so it must act"),
    (_step(1, ["car-0", "car-1", "car-2"], 3, acted=2, joined=["car-2"]),
     "step 1: joined[0]: 'car-2' must not be joined on its first step of the stream"),
    (_step(1, ["car-0", "car-1"], 2, acted=3), "step 1: rewards: must be float32 [2]"),
])
def test_misuse_ends_only_its_own_session_with_invalid_argument_naming_agent_and_field(stack, second, message):
    rng = np.random.default_rng(1)
    with agents_client(stack.actor, "good") as good:
        good.reset({"car-0": rng.normal(size=OBS_SHAPE)})
        raw = RawSession(stack.actor)
        try:
            raw.send(_agents_hello("bad"))
            assert raw.recv().WhichOneof("kind") == "accepted"
            raw.send(_step(0, ["car-0", "car-1"], 2))
            assert raw.recv().actions.step_id == 0
            raw.send(second)
            code, details = raw.status()
        finally:
            raw.close()
        assert code == "INVALID_ARGUMENT" and message in details, details
        # The other session goes on.
        out = good.step({"car-0": rng.normal(size=OBS_SHAPE)}, rewards={"car-0": 0.0}, terminated={"car-0": False},
                        truncated={"car-0": False})
        assert list(out) == ["car-0"]


def test_a_hello_naming_an_agent_twice_is_refused(stack):
    raw = RawSession(stack.actor)
    try:
        raw.send(_agents_hello("twice", ["car-0", "car-1", "car-0"]))
        code, details = raw.status()
    finally:
        raw.close()
    assert code == "INVALID_ARGUMENT" and "agent_ids[2]: 'car-0' is agent_ids[0] too" in details

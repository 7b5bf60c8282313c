"""A session of several agents (hello.agent_ids; services/actor/sessions.py): agents that join, end and act
on, leave, and join again, mid-fragment; every step of every agent is recorded exactly once, as a
naive per-agent log of the script says, and every misuse is refused naming the agent and the field."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kuberl.v1 import actor_pb2
from kuberl.v1 import common_pb2 as pb
from services.actor.sessions import SessionError, SessionHub
from services.common.models.nets import EnvSpec
from services.common.protocol.fragments import RawFragment, decode_fragment
from services.common.protocol.spaces import Discrete
from services.common.protocol.tensors import encode
from services.common.stats import Metrics
from services.config import config_from_dict

SPEC = EnvSpec((3,), np.dtype(np.float32), Discrete(2))
AGENTS = ["a0", "a1", "a2"]


def hub(T: int = 4):
    cfg = config_from_dict({"algorithm": "ppo", "env": {"mode": "external"}, "ppo": {"rollout_steps": T}})
    out: list = []
    return SessionHub(cfg, SPEC, "actor-x", Metrics("actor"), lambda frag: out.append(RawFragment(frag.payload))), out


def hello(sid="s", ids=AGENTS, num_envs=0):
    return actor_pb2.EnvHello(session_id=sid, num_envs=num_envs, agent_ids=ids, observation_space=actor_pb2.Space(
        box=actor_pb2.BoxSpace(shape=[3], dtype=pb.DTYPE_FLOAT32)), action_space=actor_pb2.Space(
        discrete=actor_pb2.DiscreteSpace(n=2)))


def step(k, agents, obs, outcomes=None, final=None, joined=(), no_agents=False):
    msg = actor_pb2.EnvStep(step_id=k, agents=agents, joined=joined, no_agents=no_agents,
                            observations=encode(np.asarray(obs, np.float32).reshape(-1, 3)))
    if outcomes is not None:
        rewards, term, trunc = outcomes
        msg.rewards.CopyFrom(encode(np.asarray(rewards, np.float32)))
        msg.terminated.CopyFrom(encode(np.asarray(term, bool)))
        msg.truncated.CopyFrom(encode(np.asarray(trunc, bool)))
    if final is not None and len(final):
        msg.final_observations.CopyFrom(encode(np.asarray(final, np.float32).reshape(len(final), 3)))
    return msg


# Per step k (the step whose outcomes end it): "end" ends the agent's episode and it leaves, "reset"
# ends it and it acts on with a new one (same step), "join" brings it (back) in.
SCRIPT = {
    0: {"a0": "join", "a2": "join"},
    3: {"a1": "join"},                     # a first appearance, mid-fragment
    5: {"a0": "reset"},                    # truncated, acts on
    6: {"a2": "reset"},                    # terminated, acts on
    8: {"a1": "end"},                      # terminated, leaves for good
    11: {"a0": "end"},                     # terminated, leaves...
    14: {"a0": "join"},                    # ...and joins again
}
STEPS = 21


def obs_of(agent: str, k: int, life: int) -> np.ndarray:
    return np.array([AGENTS.index(agent), k, life], np.float32)


def run_script(h, s, steps=STEPS, script=SCRIPT):
    """Drive the session; return the naive log: per agent, its transitions (obs, action, reward,
    terminated, truncated, next obs) in order, with the session's close truncating the running ones.
    A step on which no agent acts is sent with no_agents (and takes no row of the window)."""
    log: dict[str, list] = {a: [] for a in AGENTS}
    rows = 0   # rows of windows filled: one per step that carries some agent's outcomes
    acting: list[str] = []
    life = dict.fromkeys(AGENTS, 0)
    current: dict[str, np.ndarray] = {}
    actions: dict[str, int] = {}
    for k in range(steps + 1):
        events = script.get(k, {})
        outcomes = final = None
        joined = [a for a, e in events.items() if e == "join" and k > 0 and any(log[a])]
        if k > 0:
            rewards, term, trunc, final = [], [], [], []
            for a in acting:
                kind = events.get(a)
                ends = kind in ("end", "reset")
                u_ = kind == "reset" and a == "a0"           # a0's reset is a truncation, a2's a termination
                t_ = ends and not u_
                r = 10.0 * AGENTS.index(a) + k
                rewards.append(r)
                term.append(t_)
                trunc.append(u_)
                nxt = obs_of(a, k, life[a]) if not ends else obs_of(a, k, life[a]) * -1   # the true last
                if ends:
                    final.append(nxt)
                log[a].append((current[a], actions[a], r, t_, u_, nxt))
            outcomes = (rewards, term, trunc) if acting else None   # (after a step of no agents: none)
            rows += bool(acting)
        now = [a for a in acting if events.get(a) != "end"]
        now += [a for a, e in events.items() if e == "join"]
        for a in now:
            if events.get(a) in ("reset", "join") and k > 0:
                life[a] += 1
            current[a] = obs_of(a, k, life[a])
        got = h.observe(s, step(k, now, [current[a] for a in now], outcomes, final, joined, no_agents=not now))
        assert got.tolist() == [current[a].tolist() for a in now] and got.shape[1:] == (3,)
        actions = {a: (k + AGENTS.index(a)) % 2 for a in now}
        h.record_actions(s, np.array([actions[a] for a in now]),
                         {"behaviour_logprob": np.full(len(now), -0.5, np.float32)}, version=k)
        acting = now
    # The close truncates each running episode at its last recorded step, bootstrapped from the
    # observation the agent was last sent (its actions on it have no outcome yet); where the last
    # window was full, it was cut already, and nothing is left to truncate.
    for a in acting if rows % h.cfg.rollout_steps else ():
        if log[a] and not (log[a][-1][3] or log[a][-1][4]):
            o, act, r, _, _, _ = log[a][-1]
            log[a][-1] = (o, act, r, False, True, current[a])
    h.close(s, "closed")
    return log


def recorded(out) -> dict[int, list]:
    """Per env id (slot), the transitions the fragments hold, in fragment order."""
    got: dict[int, list] = {}
    for m in out:
        f = decode_fragment(m, algorithm=pb.ALGORITHM_PPO)
        nxt = f.next_obs()
        for c, env in enumerate(f.env_ids):
            for t in range(f.num_steps):
                got.setdefault(env, []).append((f.obs[t, c], int(f.actions[t, c]), float(f.rewards[t, c]),
                                                bool(f.terminated[t, c]), bool(f.truncated[t, c]), nxt[t, c]))
    return got


def assert_recorded_as_logged(out, log, s) -> None:
    """Every agent's recorded steps (the fragments `out`) are its steps in the naive per-agent `log`."""
    got = recorded(out)
    for i, a in enumerate(AGENTS):
        want, have = log[a], got.get(s.env_id_base + i, [])
        assert len(have) == len(want), (a, len(have), len(want))
        for u, (w, g) in enumerate(zip(want, have)):
            assert np.array_equal(w[0], g[0]) and w[1:5] == g[1:5] and np.array_equal(w[5], g[5]), (a, u, w, g)


@pytest.mark.parametrize("T", [4, 7, 30])
def test_every_step_of_every_agent_is_recorded_once_as_the_script_says(T):
    h, out = hub(T)
    s, _ = h.open(hello())
    log = run_script(h, s)
    assert_recorded_as_logged(out, log, s)
    steps = sum(len(v) for v in log.values())
    assert h.metrics.counters["actor/env_steps_total"] == steps
    assert sum(decode_fragment(m, algorithm=pb.ALGORITHM_PPO).num_samples for m in out) == steps
    assert [m.seq for m in out] == list(range(len(out)))
    # Episodes: every one the script ended is reported (those the close cut short are not finished).
    ends = sum(1 for events in SCRIPT.values() for e in events.values() if e in ("end", "reset"))
    assert h.metrics.counters["actor/episodes_total"] == ends == 4


def test_the_script_really_makes_agents_join_leave_and_come_back():
    h, out = hub(4)
    s, _ = h.open(hello())
    log = run_script(h, s)
    assert len(log["a1"]) == 8 - 3 and len(log["a0"]) == 11 + (STEPS - 14)   # a1 joined late; a0 was away 3 steps
    assert len({len(decode_fragment(m, algorithm=pb.ALGORITHM_PPO).env_ids) for m in out}) > 1   # runs of fewer agents


def opened(h):
    s, _ = h.open(hello())
    h.observe(s, step(0, ["a0", "a1"], np.zeros((2, 3))))
    h.record_actions(s, np.array([0, 1]), {"behaviour_logprob": np.zeros(2, np.float32)}, version=1)
    return s


@pytest.mark.parametrize("bad,message", [
    (lambda: step(1, ["a0", "zz"], np.zeros((2, 3)), ([0, 0], [False, False], [False, False])),
     "step 1: agents[1]: 'zz' is not one of hello.agent_ids"),
    (lambda: step(1, ["a0", "a0"], np.zeros((2, 3)), ([0, 0], [False, False], [False, False])),
     "step 1: agents[1]: 'a0' is agents[0] too"),
    (lambda: step(1, ["a0"], np.zeros((1, 3)), ([0, 0], [False, False], [False, False])),
     "step 1: agents: 'a1' acted on step 0 and did not end, so it must act on this step"),
    (lambda: step(1, ["a0", "a1"], np.zeros((2, 3)), ([0, 0], [False, False], [False, False]), joined=["a1"]),
     "step 1: joined[0]: 'a1' has not ended"),
    (lambda: step(1, ["a0", "a1", "a2"], np.zeros((3, 3)), ([0, 0], [False, False], [False, False]), joined=["a2"]),
     "step 1: joined[0]: 'a2' must not be joined on its first step of the stream (a first step takes no join"),
    (lambda: step(1, ["a0"], np.zeros((1, 3)), ([0, 0], [True, True], [False, False]), final=np.zeros((2, 3)),
                  no_agents=True),
     "step 1: agents: names 1 agents ('a0' first), but no_agents says none acts"),
    (lambda: step(1, [], np.zeros((0, 3)), ([0, 0], [True, False], [False, False]), final=np.zeros((1, 3)),
                  no_agents=True),
     "step 1: agents: 'a1' acted on step 0 and did not end, so it must act on this step (end it with terminated or "
     "truncated first) (no_agents: no agent acts)"),
    (lambda: step(1, [], np.zeros((1, 3)), ([0, 0], [True, True], [False, False]), final=np.zeros((2, 3)),
                  no_agents=True),
     "step 1: observations: must be float32 [0, 3]"),
    (lambda: step(1, ["a0", "a1"], np.zeros((2, 3)), ([0, 0, 0], [False] * 3, [False] * 3)),
     "step 1: rewards: must be float32 [2]"),
    (lambda: step(1, ["a0", "a1"], np.zeros((3, 3)), ([0, 0], [False, False], [False, False])),
     "step 1: observations: must be float32 [2, 3]"),
])
def test_misuse_is_refused_naming_the_agent_and_the_field(bad, message):
    h, _ = hub()
    s = opened(h)
    with pytest.raises(SessionError, match=re.escape(message)) as err:
        h.observe(s, bad())
    assert err.value.code == "INVALID_ARGUMENT"


def test_an_agent_acting_after_its_end_without_joining_is_refused():
    h, _ = hub()
    s = opened(h)
    h.observe(s, step(1, ["a0"], np.zeros((1, 3)), ([0, 1], [False, True], [False, False]), final=np.zeros((1, 3))))
    h.record_actions(s, np.array([0]), {"behaviour_logprob": np.zeros(1, np.float32)}, version=1)
    with pytest.raises(SessionError, match=r"step 2: agents\[1\]: 'a1' left after its episode ended; it acts again "
                                           r"only when listed in joined"):
        h.observe(s, step(2, ["a0", "a1"], np.zeros((2, 3)), ([0], [False], [False])))
    h2, _ = hub()
    s2 = opened(h2)   # the same, joined: accepted
    h2.observe(s2, step(1, ["a0"], np.zeros((1, 3)), ([0, 1], [False, True], [False, False]), final=np.zeros((1, 3))))
    h2.record_actions(s2, np.array([0]), {"behaviour_logprob": np.zeros(1, np.float32)}, version=1)
    assert h2.observe(s2, step(2, ["a0", "a1"], np.ones((2, 3)), ([0], [False], [False]), joined=["a1"])).shape == (2, 3)


@pytest.mark.parametrize("ids,num_envs,message", [
    (["a", "b", "a"], 0, r"agent_ids\[2\]: 'a' is agent_ids\[0\] too"),
    (["a", ""], 0, r"agent_ids\[1\]: must be 1..128 characters"),
    (["a", "b"], 3, r"num_envs: 3, but agent_ids names 2 agents"),
])
def test_a_hello_with_bad_agent_ids_is_refused(ids, num_envs, message):
    h, _ = hub()
    with pytest.raises(SessionError, match=message) as err:
        h.open(hello(ids=ids, num_envs=num_envs))
    assert err.value.code == "INVALID_ARGUMENT"


def test_a_recurrent_policy_keeps_a_state_per_agent_moved_only_where_it_acts_and_fresh_at_each_new_life():
    """ppo.recurrent over a session of several agents: the hub keeps each agent's state, hands inference
    the rows of the agents acting now (`state_of`), moves only theirs, zeroes an agent's where its
    episode ends, and a fragment's run that starts after the window's first step (an agent's new life)
    starts from zeros, whatever the slot held when the window began."""
    T = 4
    cfg = config_from_dict({"algorithm": "ppo", "env": {"mode": "external"},
                            "ppo": {"rollout_steps": T, "recurrent": "gru", "recurrent_size": 2}})
    out: list = []
    h = SessionHub(cfg, SPEC, "actor-x", Metrics("actor"), lambda frag: out.append(RawFragment(frag.payload)),
                   state_size=2)
    s, _ = h.open(hello())

    def act(k, rows):   # the policy's state after step k's actions: k + 1 in every acting row
        h.record_actions(s, np.zeros(rows, np.int64), {"behaviour_logprob": np.zeros(rows, np.float32)}, version=1,
                         state=np.full((rows, 2), k + 1.0, np.float32))

    everyone, calm = ["a0", "a1", "a2"], ([0.0] * 3, [False] * 3, [False] * 3)
    h.observe(s, step(0, ["a0", "a1"], np.zeros((2, 3))))
    assert h.state_of(s).shape == (2, 2) and not h.state_of(s).any()
    act(0, 2)
    assert s.episodes.state.tolist() == [[1, 1], [1, 1], [0, 0]]   # a2 has not acted: untouched
    h.observe(s, step(1, everyone, np.zeros((3, 3)), ([0.0] * 2, [False] * 2, [False] * 2)))
    assert h.state_of(s).tolist() == [[1, 1], [1, 1], [0, 0]]      # the rows acting now, in the step's order
    act(1, 3)
    for k in (2, 3, 4):   # window 1 ends at step 4's outcomes: window 2 starts from every agent's state 4
        h.observe(s, step(k, everyone, np.zeros((3, 3)), calm))
        act(k, 3)
    assert len(out) == 2 and s.t == 0   # (window 1: a0, a1 throughout; a2 from its second step)
    # Step 5: a0 terminated and leaves; step 6: it joins again, a new life in the middle of window 2.
    h.observe(s, step(5, ["a1", "a2"], np.zeros((2, 3)), ([0.0] * 3, [True, False, False], [False] * 3),
                      final=np.zeros((1, 3))))
    assert s.episodes.state.tolist() == [[0, 0], [5, 5], [5, 5]]   # a0's life ended: zeroed
    act(5, 2)
    h.observe(s, step(6, everyone, np.zeros((3, 3)), ([0.0] * 2, [False] * 2, [False] * 2), joined=["a0"]))
    act(6, 3)
    h.observe(s, step(7, everyone, np.zeros((3, 3)), calm))
    act(7, 3)
    h.observe(s, step(8, everyone, np.zeros((3, 3)), calm))
    frags = [decode_fragment(f, algorithm=pb.ALGORITHM_PPO, extras=("behaviour_logprob",),
                             start_extras=("core_state",)) for f in out[2:]]
    runs = sorted((f.env_ids.tolist() if hasattr(f.env_ids, "tolist") else list(f.env_ids), f.rewards.shape[0],
                   f.extras["core_state"].tolist()) for f in frags)
    # a1 and a2 throughout from the window's state; a0's first step from it too; a0's new life from zeros.
    assert runs == [([0], 1, [[4, 4]]), ([0], 2, [[0, 0]]), ([1, 2], 4, [[4, 4], [4, 4]])]


# A step of no agents (EnvStep.no_agents): the prey were all caught, the game goes on, a prey comes back.
GAPS = {
    0: {"a0": "join", "a1": "join"},
    2: {"a0": "end"},
    3: {"a1": "end"},                      # step 3: no agent acts...
    6: {"a2": "join"},                     # ...until step 6 (3, 4, 5: none), a first appearance
    7: {"a2": "end"},                      # step 7: none again
    8: {"a1": "join"},                     # back, joined
    10: {"a1": "reset"},
    12: {"a1": "end"},                     # 12..16: none
    17: {"a0": "join", "a2": "join"},
}


@pytest.mark.parametrize("T", [2, 3, 4, 30])
def test_steps_of_no_agents_record_nothing_and_every_agent_step_is_recorded_once(T):
    """Stretches of steps on which no agent acts, inside and across windows: the actor answers each
    with 0 rows, records every agent step once (as the naive log says) and nothing for them: no
    fragment holds a step nobody took, the env step and episode counts are the agents'."""
    h, out = hub(T)
    s, _ = h.open(hello())
    log = run_script(h, s, steps=20, script=GAPS)
    assert_recorded_as_logged(out, log, s)
    steps = sum(len(v) for v in log.values())
    assert steps == (2 + 3) + (3 + 4) + (1 + 3)   # a0, a1, a2: each life's steps
    assert h.metrics.counters["actor/env_steps_total"] == steps
    frags = [decode_fragment(m, algorithm=pb.ALGORITHM_PPO) for m in out]
    assert sum(f.num_samples for f in frags) == steps and all(f.num_samples for f in frags)
    assert [m.seq for m in out] == list(range(len(out)))
    assert h.metrics.counters["actor/episodes_total"] == 5   # a0 at 2; a1 at 3, 10 (acts on), 12; a2 at 7


def test_a_step_of_no_agents_takes_no_row_so_a_stretch_of_them_cuts_no_fragment():
    """Six steps of no agents with windows of 2: not one fragment; the next agent's steps fill the row
    the last agent's outcomes left, so its 2 steps make the one full window. Outcome tensors of no
    agents may be absent (the step after a step of no agents) or empty."""
    h, out = hub(2)
    s, _ = h.open(hello())
    h.observe(s, step(0, ["a0"], np.zeros((1, 3))))
    h.record_actions(s, np.array([1]), {"behaviour_logprob": np.zeros(1, np.float32)}, version=3)
    got = h.observe(s, step(1, [], np.zeros((0, 3)), ([1.0], [True], [False]), final=np.ones((1, 3)), no_agents=True))
    assert got.shape == (0, 3) and h.state_of(s) is None
    h.record_actions(s, np.zeros(0, np.int64), {"behaviour_logprob": np.zeros(0, np.float32)}, version=4)
    assert s.t == 1 and not out
    for k in range(2, 8):   # no agent acts; the outcomes (of none) absent, or empty
        msg = actor_pb2.EnvStep(step_id=k, no_agents=True)
        if k % 2:
            msg = step(k, [], np.zeros((0, 3)), ([], [], []), no_agents=True)
        assert h.observe(s, msg).shape == (0, 3)
        h.record_actions(s, np.zeros(0, np.int64), {"behaviour_logprob": np.zeros(0, np.float32)}, version=4)
    assert s.t == 1 and not out and h.metrics.counters["actor/env_steps_total"] == 1
    h.observe(s, step(8, ["a1"], np.full((1, 3), 8.0)))
    h.record_actions(s, np.array([0]), {"behaviour_logprob": np.zeros(1, np.float32)}, version=5)
    h.observe(s, step(9, ["a1"], np.full((1, 3), 9.0), ([2.0], [False], [False])))
    assert len(out) == 2   # the window [a0's last step, a1's first] is full: a fragment per run
    frags = sorted((decode_fragment(m, algorithm=pb.ALGORITHM_PPO) for m in out), key=lambda f: list(f.env_ids))
    a0, a1 = frags
    assert list(a0.env_ids) == [0] and a0.num_steps == 1 and a0.terminated.tolist() == [[True]]
    assert list(a1.env_ids) == [1] and a1.num_steps == 1 and a1.rewards.tolist() == [[2.0]]
    assert a1.obs[0].tolist() == [[8.0] * 3] and a1.next_obs()[0].tolist() == [[9.0] * 3]
    assert a0.policy_version == 3 and a1.policy_version == 3   # (the window's oldest weights: a0's step)


def test_no_agents_is_refused_in_a_session_without_agent_ids():
    h, _ = hub()
    s, _ = h.open(hello(ids=[], num_envs=2))
    with pytest.raises(SessionError, match=re.escape("step 0: no_agents: only a session of several agents "
                                                     "(hello.agent_ids) has a step of no agents")) as err:
        h.observe(s, actor_pb2.EnvStep(step_id=0, no_agents=True))
    assert err.value.code == "INVALID_ARGUMENT"


def test_joined_on_step_0_is_refused_as_a_first_step():
    h, _ = hub()
    s, _ = h.open(hello())
    with pytest.raises(SessionError, match=re.escape("step 0: joined[0]: 'a1' must not be joined on its first step "
                                                     "of the stream")):
        h.observe(s, step(0, ["a0", "a1"], np.zeros((2, 3)), joined=["a1"]))


def _refusal(cfg_extra: dict, msg) -> str:
    cfg = config_from_dict({"algorithm": "ppo", "env": {"mode": "external"}, "ppo": {"rollout_steps": 4},
                            **cfg_extra})
    h = SessionHub(cfg, SPEC, "actor-x", Metrics("actor"), lambda frag: None)
    hi = hello()
    hi.observation_space.box.low.append(-5.0)
    hi.observation_space.box.high.append(5.0)
    s, _ = h.open(hi)
    h.observe(s, step(0, ["a2", "a0"], np.zeros((2, 3))))
    h.record_actions(s, np.array([0, 1]), {"behaviour_logprob": np.zeros(2, np.float32)}, version=1)
    with pytest.raises(SessionError) as err:
        h.observe(s, msg)
    assert err.value.code == "INVALID_ARGUMENT"
    return str(err.value)


NAN = float("nan")


@pytest.mark.parametrize("cfg,msg,message", [
    ({}, step(1, ["a1", "a0"], [[0, 0, 0], [0, NAN, 0]], ([0, 0], [False, False], [False, False])),
     "step 1: observations[1] of agent 'a0' is nan (NaN and infinity are refused)"),
    ({}, step(1, ["a2", "a0"], np.zeros((2, 3)), ([0, float("inf")], [False, False], [False, False])),
     "step 1: rewards of agent 'a0' is inf"),
    ({}, step(1, ["a0"], np.zeros((1, 3)), ([0, 0], [True, False], [False, False]), final=[[0, 0, NAN]]),
     "step 1: final_observations[2] of agent 'a2' is nan"),
    ({"actor": {"check_obs_bounds": True}},
     step(1, ["a1", "a2", "a0"], [[0, 0, 0], [0, 0, 0], [9, 0, 0]], ([0, 0], [False, False], [False, False])),
     "step 1: observations[0] of agent 'a0' is 9, outside its declared bounds [-5, 5]"),
])
def test_bad_values_are_refused_naming_the_agent_not_its_row(cfg, msg, message):
    """docs/multi-agent.md: misuse names the agent and the field. The rows here are not the slots (a2
    acted first at step 0; a0 is row 1 or 2), so a row number would name the wrong agent."""
    text = _refusal(cfg, msg)
    assert message in text and "env " not in text, text


def test_an_action_mask_that_allows_nothing_is_refused_naming_the_agent():
    msg = step(1, ["a2", "a0"], np.zeros((2, 3)), ([0, 0], [False, False], [False, False]))
    msg.action_masks.CopyFrom(encode(np.array([[True, False], [False, False]])))
    text = _refusal({}, msg)
    assert "step 1: action_masks: allows no value of the action somewhere" in text and "(agent 'a0', row 1)" in text


NODE_STEPS = r"""
const path = require('path');
const protoLoader = require('@grpc/proto-loader');
const { agentsStep, decodeDiscrete } = require('../node-common/envsession');
const pd = protoLoader.loadSync('kuberl/v1/actor.proto', { includeDirs: [path.resolve('../../protos')], keepCase: true,
  longs: Number, enums: Number, defaults: true, oneofs: true });
const rpc = pd['kuberl.v1.Actor'].EnvSession;
const steps = [
  agentsStep(0, ['a0', 'a1'], [[0, 0, 0], [1, 1, 1]], 3),
  agentsStep(1, [], [], 3, [{ reward: 1, terminated: true, truncated: false, final: [2, 2, 2] },
    { reward: 0.5, terminated: false, truncated: true, final: [3, 3, 3] }]),
  agentsStep(2, [], [], 3, null),
  agentsStep(3, ['a1'], [[4, 4, 4]], 3, [], ['a1']),
];
const reply = rpc.responseDeserialize(Buffer.from(process.argv[1], 'base64'));
console.log(JSON.stringify({ steps: steps.map((step) => rpc.requestSerialize({ step }).toString('base64')),
  actions: decodeDiscrete(reply.actions.actions, 0, 2) }));
"""


def test_the_node_client_sends_a_step_of_no_agents_as_no_agents():
    """examples/node-common's agentsStep on the wire (serialized by @grpc/proto-loader, as the examples
    send it): a step of no agents says no_agents, with no observations and no outcomes after it; the
    actor's hub takes each step, and the Node side decodes the 0-row reply."""
    example = Path(__file__).resolve().parents[3] / "examples" / "node-crossing"
    node = shutil.which("node")
    if node is None or not (example / "node_modules" / "@grpc" / "proto-loader").exists():
        pytest.skip("Node.js and examples/node-crossing's packages (npm ci there) are needed")
    reply = actor_pb2.ActorMessage(actions=actor_pb2.ActionReply(step_id=1, actions=encode(np.zeros(0, np.int64))))
    out = subprocess.run([node, "-e", NODE_STEPS, base64.b64encode(reply.SerializeToString()).decode()], cwd=example,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["actions"] == []
    msgs = [actor_pb2.EnvMessage.FromString(base64.b64decode(m)).step for m in got["steps"]]
    assert [m.no_agents for m in msgs] == [False, True, True, False]
    assert not msgs[1].HasField("observations") and not msgs[2].HasField("rewards")
    h, _ = hub()
    s, _ = h.open(hello())
    for m, rows in zip(msgs, (2, 0, 0, 1)):
        assert h.observe(s, m).shape == (rows, 3)
        h.record_actions(s, np.zeros(rows, np.int64), {"behaviour_logprob": np.zeros(rows, np.float32)}, version=1)
    assert h.metrics.counters["actor/env_steps_total"] == 2 and h.metrics.counters["actor/episodes_total"] == 2

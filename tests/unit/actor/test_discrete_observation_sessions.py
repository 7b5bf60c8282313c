"""EnvSession with a Discrete or MultiDiscrete observation (issue 53 item 9): a hello declaring the
policy's space is accepted and its steps become fragments of int64 observations; another space is
refused; a value outside 0..n-1 ends the session with INVALID_ARGUMENT naming the field and env, before
anything of it is recorded; kuberl_client declares such a space."""

from __future__ import annotations

import numpy as np
import pytest

from kuberl.v1 import actor_pb2
from kuberl.v1 import common_pb2 as pb
from services.actor.sessions import SessionError, SessionHub
from services.common.protocol import spaces
from services.common.protocol.fragments import RawFragment, decode_fragment
from services.common.protocol.spaces import Discrete, MultiDiscrete
from services.common.protocol.tensors import encode
from services.common.stats import Metrics
from services.config import config_from_dict

T, N = 2, 2
LAKE = spaces.discrete_spec(Discrete(16), Discrete(4))
GRID = spaces.discrete_spec(MultiDiscrete((4, 3)), Discrete(4))


def hub(spec):
    cfg = config_from_dict({"algorithm": "ppo", "env": {"mode": "external"}, "ppo": {"rollout_steps": T}})
    out: list = []
    return SessionHub(cfg, spec, "actor-x", Metrics("actor"), lambda f: out.append(RawFragment(f.payload))), out


def hello(obs_space, sid="s"):
    msg = actor_pb2.EnvHello(session_id=sid, num_envs=N)
    spaces.to_proto(obs_space, msg.observation_space)
    spaces.to_proto(Discrete(4), msg.action_space)
    return msg


def step(k, obs, rewards=None):
    msg = actor_pb2.EnvStep(step_id=k, observations=encode(np.asarray(obs, np.int64)))
    if rewards is not None:
        msg.rewards.CopyFrom(encode(np.asarray(rewards, np.float32)))
        msg.terminated.CopyFrom(encode(np.zeros(N, bool)))
        msg.truncated.CopyFrom(encode(np.zeros(N, bool)))
    return msg


@pytest.mark.parametrize("spec, space, obs", [(LAKE, Discrete(16), lambda k: [k, 15 - k]),
                                              (GRID, MultiDiscrete((4, 3)), lambda k: [[k % 4, 2], [3, k % 3]])],
                         ids=["discrete", "multi-discrete"])
def test_a_session_declaring_the_policys_discrete_space_records_int64_observations(spec, space, obs):
    """(~0.1 s)"""
    h, out = hub(spec)
    s, _ = h.open(hello(space))
    for k in range(T + 1):
        h.observe(s, step(k, obs(k), None if k == 0 else [1.0, 0.0]))
        h.record_actions(s, np.array([0, 3]), {"behaviour_logprob": np.full(N, -1.4, np.float32)}, version=1)
    (frag,) = [decode_fragment(m, algorithm=pb.ALGORITHM_PPO) for m in out]
    assert frag.obs.dtype == np.int64 and frag.obs.shape == (T + 1, N, *spec.obs_shape)
    np.testing.assert_array_equal(frag.obs, [obs(k) for k in range(T + 1)])


@pytest.mark.parametrize("space, want", [
    (Discrete(15), "observation_space: expected Discrete(16), got Discrete(15)"),
    (MultiDiscrete((16,)), "observation_space: expected Discrete(16), got MultiDiscrete([16])"),
], ids=["other-n", "multi-discrete"])
def test_a_session_declaring_another_space_is_refused(space, want):
    """(~0.01 s)"""
    h, _ = hub(LAKE)
    with pytest.raises(SessionError) as err:
        h.open(hello(space))
    assert err.value.code == "INVALID_ARGUMENT" and str(err.value) == want
    box = actor_pb2.EnvHello(session_id="b", num_envs=N)
    box.observation_space.box.shape[:] = [1]
    box.observation_space.box.dtype = pb.DTYPE_INT64
    spaces.to_proto(Discrete(4), box.action_space)
    with pytest.raises(SessionError, match=r"^observation_space: expected Discrete\(16\), got box"):
        h.open(box)


@pytest.mark.parametrize("value", [16, -1])
def test_an_observation_outside_the_space_ends_the_session_naming_it(value):
    """(~0.01 s)"""
    h, out = hub(LAKE)
    s, _ = h.open(hello(Discrete(16)))
    h.observe(s, step(0, [3, 4]))
    h.record_actions(s, np.array([0, 3]), {"behaviour_logprob": np.full(N, -1.4, np.float32)}, version=1)
    with pytest.raises(SessionError) as err:
        h.observe(s, step(1, [5, value], [1.0, 1.0]))
    assert err.value.code == "INVALID_ARGUMENT"
    assert f"observations of env 1 is {value}, outside 0..15 (a categorical observation of 16 values)" in str(err.value)
    assert h.metrics.counters["actor/steps_refused_out_of_bounds_total"] == 1 and out == []


def test_kuberl_client_declares_a_discrete_observation():
    """The client's constructor and the gymnasium adapter take a Discrete observation (~0.1 s)."""
    import gymnasium as gym

    from kuberl_client import EnvSessionClient
    from kuberl_client.gym import _spaces, as_vector_env

    client = EnvSessionClient("127.0.0.1:1", session_id="c", num_envs=2, obs_space=Discrete(16), num_actions=4)
    assert client.obs_shape == () and client.obs_dtype == np.int64
    np.testing.assert_array_equal(client._observations([3, 15], "observations"), [3, 15])
    with pytest.raises(ValueError, match="exactly one"):
        EnvSessionClient("127.0.0.1:1", session_id="c", num_envs=2, obs_space=Discrete(16), obs_shape=(1,),
                         num_actions=4)
    envs = as_vector_env(gym.make("FrozenLake-v1"))
    try:
        kw, _ = _spaces(envs)
        assert kw["obs_space"] == Discrete(16)
    finally:
        envs.close()

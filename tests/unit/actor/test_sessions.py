"""SessionHub: external simulator steps become fragments exactly like local envs' do."""

from __future__ import annotations

import numpy as np
import pytest

from kuberl.v1 import actor_pb2
from kuberl.v1 import common_pb2 as pb
from services.actor.sessions import SessionError, SessionHub
from services.config import config_from_dict
from services.common.protocol.fragments import RawFragment, decode_fragment
from services.common.models.nets import EnvSpec
from services.common.protocol import spaces
from services.common.protocol.spaces import Box, Discrete, MultiDiscrete
from services.common.stats import Metrics
from services.common.protocol.tensors import encode

SPEC = EnvSpec((3,), np.dtype(np.float32), Discrete(2))
T, N = 4, 2


def sink(out: list):
    """An on_fragment that keeps each payload as the buffer reads it (RawFragment: decode_fragment takes it)."""
    return lambda frag: out.append(RawFragment(frag.payload))


def hub(**actor):
    cfg = config_from_dict({"algorithm": "ppo", "env": {"mode": "external"}, "ppo": {"rollout_steps": T},
                            "actor": actor})
    out = []
    return SessionHub(cfg, SPEC, "actor-x", Metrics("actor"), sink(out)), out


def hello(sid="s", n=N, shape=(3,), dtype=pb.DTYPE_FLOAT32, actions=2):
    return actor_pb2.EnvHello(session_id=sid, num_envs=n, observation_space=actor_pb2.Space(
        box=actor_pb2.BoxSpace(shape=shape, dtype=dtype)), action_space=actor_pb2.Space(
        discrete=actor_pb2.DiscreteSpace(n=actions)))


def step(k, obs, rewards=None, term=None, trunc=None, final=None):
    msg = actor_pb2.EnvStep(step_id=k, observations=encode(np.asarray(obs, np.float32)))
    if rewards is not None:
        msg.rewards.CopyFrom(encode(np.asarray(rewards, np.float32)))
        msg.terminated.CopyFrom(encode(np.asarray(term, bool)))
        msg.truncated.CopyFrom(encode(np.asarray(trunc, bool)))
    if final is not None:
        msg.final_observations.CopyFrom(encode(np.asarray(final, np.float32)))
    return msg


def obs_at(k):
    return np.full((N, 3), k, np.float32) + np.arange(N, dtype=np.float32)[:, None] / 10


def drive(h, s, steps, end_at=None):
    """step 0..steps; env 0 terminates at step `end_at` (final obs -1)."""
    h.observe(s, step(0, obs_at(0)))
    h.record_actions(s, np.array([0, 1]), {"behaviour_logprob": np.array([-0.5, -0.6], np.float32)}, version=3)
    for k in range(1, steps + 1):
        term = [k == end_at, False]
        final = [np.full(3, -1.0)] if k == end_at else None
        h.observe(s, step(k, obs_at(k), rewards=[1.0, 2.0], term=term, trunc=[False, False], final=final))
        h.record_actions(s, np.array([1, 0]), {"behaviour_logprob": np.array([-0.7, -0.8], np.float32)}, version=3 + k)


def test_steps_become_valid_fragments_of_rollout_steps():
    h, out = hub()
    s, resumed = h.open(hello())
    assert not resumed
    drive(h, s, steps=2 * T, end_at=2)
    assert len(out) == 2
    frags = [decode_fragment(m, algorithm=pb.ALGORITHM_PPO) for m in out]
    first = frags[0]
    assert first.num_steps == T and first.num_envs == N
    np.testing.assert_array_equal(first.obs[:, 0, 0], [0, 1, 2, 3, 4])  # obs[t+1] is the next observation
    assert first.terminated[1, 0] and first.final_index.tolist() == [1 * N + 0]
    np.testing.assert_array_equal(first.next_obs()[1, 0], [-1, -1, -1])  # the true final observation
    assert first.policy_version == 3 and frags[1].policy_version == 3 + T  # the oldest version used
    assert [m.seq for m in out] == [0, 1] and list(out[1].env_ids) == [0, 1]
    np.testing.assert_array_equal(first.rewards, [[1, 2]] * T)
    assert h.episodes.count == 1 and h.episodes.episodes[0].episode_return == 2.0 and h.episodes.episodes[0].length == 2


def test_close_flushes_the_partial_fragment_with_running_episodes_truncated():
    h, out = hub()
    s, _ = h.open(hello())
    drive(h, s, steps=3, end_at=3)  # env 0 terminates at the last step, env 1 is mid-episode
    assert out == []
    h.close(s, "timeout")
    (frag,) = [decode_fragment(m) for m in out]
    assert frag.num_steps == 3
    assert frag.terminated[2].tolist() == [True, False] and frag.truncated[2].tolist() == [False, True]
    np.testing.assert_array_equal(frag.next_obs()[2, 1], obs_at(3)[1])  # bootstrap from the last obs
    assert h.metrics.counters["actor/sessions_timed_out_total"] == 1
    h.close(s, "closed")  # idempotent
    assert len(out) == 1


def test_resume_keeps_episode_returns():
    h, out = hub()
    s, _ = h.open(hello("r"))
    drive(h, s, steps=2)
    h.close(s, "closed")
    s2, resumed = h.open(hello("r"))
    assert resumed and s2.episodes.returns.tolist() == [2.0, 4.0]
    s3, resumed3 = h.open(hello("other"))
    assert not resumed3


@pytest.mark.parametrize("bad, field", [
    (hello(shape=(4,)), "observation_space"), (hello(dtype=pb.DTYPE_FLOAT64), "observation_space"),
    (hello(actions=3), "action_space"), (hello(n=0), "num_envs"), (hello(sid=""), "session_id"),
    (hello(dtype=42), "observation_space.box.dtype"),
])
def test_hello_that_does_not_fit_the_policy_is_refused(bad, field):
    h, _ = hub()
    with pytest.raises(SessionError) as err:
        h.open(bad)
    assert err.value.code == "INVALID_ARGUMENT" and str(err.value).startswith(field)
    assert h.metrics.counters["actor/sessions_refused_total"] == 1 and not h.sessions


def test_session_limit():
    h, _ = hub(max_sessions=1)
    h.open(hello("a"))
    with pytest.raises(SessionError) as full:
        h.open(hello("b"))
    assert full.value.code == "RESOURCE_EXHAUSTED"


def test_a_reconnect_takes_over_the_older_stream():
    h, out = hub()
    old, _ = h.open(hello("a"))
    drive(h, old, steps=2)
    new, resumed = h.open(hello("a"))  # the old stream has not noticed its break yet
    assert resumed and h.sessions["a"] is new and len(out) == 1  # the old one was flushed
    with pytest.raises(SessionError) as err:
        h.observe(old, step(3, obs_at(3), rewards=[1, 1], term=[0, 0], trunc=[0, 0]))
    # "stop", not "reconnect": reconnecting would take the session back from the newer stream
    assert err.value.code == "ABORTED" and "taken over" in str(err.value)
    h.close(old, "closed")  # the old handler's cleanup must not close the new session
    assert h.sessions["a"] is new


@pytest.mark.parametrize("msg, code, text", [
    (step(1, obs_at(1)), "FAILED_PRECONDITION", "step_id: expected 0"),
    (step(0, np.zeros((N, 4))), "INVALID_ARGUMENT", "observations"),
])
def test_bad_first_step(msg, code, text):
    h, _ = hub()
    s, _ = h.open(hello())
    with pytest.raises(SessionError) as err:
        h.observe(s, msg)
    assert err.value.code == code and text in str(err.value)


@pytest.mark.parametrize("kwargs, text", [
    ({"rewards": [1.0, np.nan], "term": [0, 0], "trunc": [0, 0]}, "rewards"),
    ({"rewards": [1.0, 1.0], "term": [1, 0], "trunc": [0, 0]}, "final_observations"),  # missing
    ({"rewards": [1.0, 1.0], "term": [0, 0], "trunc": [0, 0], "final": [[1, 2, 3]]}, "no env ended"),
    ({"rewards": [1.0], "term": [0, 0], "trunc": [0, 0]}, "rewards"),
])
def test_malformed_step_names_the_field(kwargs, text):
    h, _ = hub()
    s, _ = h.open(hello())
    h.observe(s, step(0, obs_at(0)))
    h.record_actions(s, np.array([0, 0]), {"behaviour_logprob": np.zeros(2, np.float32)}, 1)
    with pytest.raises(SessionError) as err:
        h.observe(s, step(1, obs_at(1), **kwargs))
    assert err.value.code == "INVALID_ARGUMENT" and text in str(err.value)


def test_shutdown_refuses_new_sessions_and_flushes_open_ones():
    h, out = hub()
    s, _ = h.open(hello())
    drive(h, s, steps=1)
    h.close_all()
    assert len(out) == 1 and not h.sessions
    with pytest.raises(SessionError) as err:
        h.open(hello("late"))
    assert err.value.code == "UNAVAILABLE"
    with pytest.raises(SessionError) as err:  # the open one's next step: "reconnect", not "stop"
        h.observe(s, step(1, obs_at(1), rewards=[1, 1], term=[0, 0], trunc=[0, 0]))
    assert err.value.code == "UNAVAILABLE" and "shutting down" in str(err.value)



def test_a_hub_without_a_fragment_sink_checks_everything_and_records_nothing():
    """`kuberl serve`: the same checks and episode statistics, no buffers, no fragments, no pacing quota."""
    cfg = config_from_dict({"algorithm": "ppo", "env": {"mode": "external"}, "ppo": {"rollout_steps": T}})
    h = SessionHub(cfg, SPEC, "serve-x", Metrics("actor"), on_fragment=None)
    with pytest.raises(SessionError) as err:
        h.open(hello(shape=(4,)))
    assert err.value.code == "INVALID_ARGUMENT" and str(err.value).startswith("observation_space")
    s, _ = h.open(hello())
    drive(h, s, steps=3 * T, end_at=2)  # three fragments' worth of steps
    assert s.buffers == {} and s.t == 0 and s.versions == [] and s.next_step == 3 * T + 1
    assert h.seq == 0 and "actor/fragments_total" not in h.metrics.counters
    assert h.env_steps == 3 * T * N and h.metrics.counters["actor/env_steps_total"] == 3 * T * N
    assert h.episodes.count == 1 and h.episodes.episodes[0].episode_return == 2.0
    with pytest.raises(SessionError) as err:
        h.observe(s, step(5, obs_at(5)))
    assert err.value.code == "FAILED_PRECONDITION"
    h.close_all()
    assert not h.sessions and h.seq == 0


# -- every space ------------------------------------------------------------------------------------
BOX = Box.of((2,), -1.0, [1.0, 2.0])
MD = MultiDiscrete((3, 2))


def spaced_hub(action, obs_keys=None, algorithm="ppo"):
    spec = EnvSpec((3,), np.dtype(np.float32), action, obs_keys)
    cfg = config_from_dict({"algorithm": algorithm, "env": {"mode": "external"},
                            algorithm: {"rollout_steps": T}})
    out = []
    return SessionHub(cfg, spec, "actor-x", Metrics("actor"), sink(out)), out


def hello_with(action=None, obs=None, sid="s"):
    msg = actor_pb2.EnvHello(session_id=sid, num_envs=N)
    if obs is None:
        msg.observation_space.box.shape[:] = (3,)
        msg.observation_space.box.dtype = pb.DTYPE_FLOAT32
    else:
        spaces.dict_layout_to_proto(spaces.dict_layout(obs), msg.observation_space.dict)
    spaces.to_proto(action, msg.action_space)
    return msg


@pytest.mark.parametrize("policy, declared, accepted", [
    (BOX, BOX, True),
    (BOX, Box.of((2,), -1.0, 1.0), False),            # other bounds
    (BOX, Box.of((1, 2), -1.0, [1.0, 2.0]), False),   # other shape
    (BOX, Discrete(2), False),
    (MD, MD, True), (MD, MultiDiscrete((2, 3)), False), (Discrete(2), MD, False),
])
def test_the_action_space_must_be_the_policys(policy, declared, accepted):
    h, _ = spaced_hub(policy)
    if accepted:
        h.open(hello_with(declared))
        return
    with pytest.raises(SessionError) as err:
        h.open(hello_with(declared))
    assert err.value.code == "INVALID_ARGUMENT"
    assert str(err.value) == f"action_space: expected {policy}, got {declared}"


def test_a_box_session_gets_clipped_float32_actions_and_its_fragments_keep_the_sample():
    h, out = spaced_hub(BOX)
    s, _ = h.open(hello_with(BOX))
    sample = np.array([[-3.0, 0.5], [0.25, 7.0]], np.float32)
    sent = h.to_send(sample)
    assert sent.dtype == np.float32 and sent.tolist() == [[-1.0, 0.5], [0.25, 2.0]]
    for k in range(T + 1):
        h.observe(s, step(k, obs_at(k), **({} if k == 0 else
                                           {"rewards": [0, 0], "term": [False] * N, "trunc": [False] * N})))
        if k < T:
            h.record_actions(s, sample, {"behaviour_logprob": np.zeros(N, np.float32)}, version=1)
    (frag,) = [decode_fragment(m) for m in out]
    np.testing.assert_array_equal(frag.actions, np.broadcast_to(sample, (T, N, 2)))  # unclipped


def masked_step(k, mask, **kw):
    msg = step(k, obs_at(k), **kw)
    msg.action_masks.CopyFrom(encode(np.asarray(mask)))
    return msg


def test_masks_from_a_simulator_reach_the_fragment_and_unmasked_steps_allow_everything():
    h, out = spaced_hub(MD)
    s, _ = h.open(hello_with(MD))
    mask = np.array([[1, 0, 1, 0, 1], [1, 1, 1, 1, 0]], bool)
    flags = {"rewards": [0, 0], "term": [False] * N, "trunc": [False] * N}
    for k in range(T + 1):
        msg = masked_step(k, mask, **({} if k == 0 else flags)) if k % 2 == 0 else step(k, obs_at(k), **flags)
        h.observe(s, msg)
        assert s.mask is None if k % 2 else s.mask.tolist() == mask.tolist()
        if k < T:
            h.record_actions(s, np.zeros((N, 2), np.int64), {"behaviour_logprob": np.zeros(N, np.float32)}, 1)
    (frag,) = [decode_fragment(m) for m in out]
    assert frag.action_mask.shape == (T, N, 5)
    np.testing.assert_array_equal(frag.action_mask[0], mask)
    assert frag.action_mask[1].all()


@pytest.mark.parametrize("mask, text", [
    (np.ones((N, 4), bool), "action_masks: must be bool [2, 5]"),
    (np.ones((N, 5), np.uint8), "action_masks: must be bool [2, 5]"),
    (np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool), "action_masks: allows no value of choice 1"),
])
def test_a_bad_mask_names_the_field(mask, text):
    h, _ = spaced_hub(MD)
    s, _ = h.open(hello_with(MD))
    with pytest.raises(SessionError) as err:
        h.observe(s, masked_step(0, mask))
    assert err.value.code == "INVALID_ARGUMENT" and text in str(err.value)


@pytest.mark.parametrize("action, algorithm, text", [
    (Discrete(2), "dqn", "algorithm dqn does not take action masks"),
    (BOX, "ppo", "Box([2], [[-1.0, -1.0], [1.0, 2.0]]) actions take no mask"),
])
def test_masks_are_refused_where_they_cannot_be_used_never_ignored(action, algorithm, text):
    h, _ = spaced_hub(action, algorithm=algorithm)
    s, _ = h.open(hello_with(action))
    with pytest.raises(SessionError) as err:
        h.observe(s, masked_step(0, np.ones((N, 2), bool)))
    assert err.value.code == "INVALID_ARGUMENT" and text in str(err.value)


KEYS = spaces.dict_layout({"pos": (2,), "vel": (1,)})


@pytest.mark.parametrize("policy_keys, declared, accepted", [
    (KEYS, {"vel": (1,), "pos": (2,)}, True),      # key order does not matter: keys are sorted
    (KEYS, {"pos": (1,), "vel": (2,)}, False),     # same flat size, another layout
    (KEYS, {"pos": (2,), "speed": (1,)}, False),
    (None, {"a": (1,), "b": (2,)}, True),          # keys not known: the flattened size must fit
    (None, {"a": (4,)}, False),
])
def test_dict_observations_must_have_the_policys_layout(policy_keys, declared, accepted):
    h, _ = spaced_hub(Discrete(2), obs_keys=policy_keys)
    if accepted:
        h.open(hello_with(Discrete(2), obs=declared))
        return
    with pytest.raises(SessionError) as err:
        h.open(hello_with(Discrete(2), obs=declared))
    assert err.value.code == "INVALID_ARGUMENT" and str(err.value).startswith("observation_space: expected ")


# -- NaN, infinity and declared bounds (services/actor/finite.py) -----------------------------------
def poisoned(k, where, value, env=1):
    """Step k >= 1 with `value` in env `env`'s "obs" (element 2), "rewards", or "final" observation
    (element 2 of env 0's: env 0 ends its episode at this step)."""
    o, r, final = obs_at(k), np.array([1.0, 2.0], np.float32), np.full((1, 3), -1.0, np.float32)
    if where == "obs":
        o[env, 2] = value
    elif where == "rewards":
        r[env] = value
    else:
        final[0, 2] = value
    return step(k, o, rewards=r, term=[True, False], trunc=[False, False], final=final)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("where, named", [("obs", "observations[2] of env 1"), ("rewards", "rewards of env 1"),
                                          ("final", "final_observations[2] of env 0")])
def test_a_step_holding_nan_or_infinity_ends_its_session_and_nothing_of_it_is_recorded(where, named, value):
    h, out = hub()
    s, _ = h.open(hello())
    drive(h, s, steps=2)
    before = {k: v.copy() for k, v in s.buffers.items()}
    with pytest.raises(SessionError) as err:
        h.observe(s, poisoned(3, where, value))
    assert err.value.code == "INVALID_ARGUMENT"
    assert str(err.value) == f"step 3: {named} is {float(value)} (NaN and infinity are refused)"
    assert h.metrics.counters["actor/steps_refused_nonfinite_total"] == 1
    assert h.metrics.counters["actor/steps_refused_out_of_bounds_total"] == 0
    assert s.t == 2 and h.env_steps == 2 * N and s.episodes.returns.tolist() == [2.0, 4.0] and h.episodes.count == 0
    for k, v in before.items():
        np.testing.assert_array_equal(s.buffers[k], v, err_msg=k)
    h.close(s, "error")  # what the servicer does next: the unfinished fragment goes out, truncated
    (frag,) = [decode_fragment(m) for m in out]
    assert frag.num_steps == 2 and frag.truncated[1].all() and not frag.terminated.any()
    assert all(np.isfinite(a).all() for a in (frag.obs, frag.rewards, frag.final_obs))
    np.testing.assert_array_equal(frag.next_obs()[1], obs_at(2))  # bootstrapped from the last good step


def test_a_first_observation_holding_infinity_is_refused_and_nothing_is_pushed():
    h, out = hub()
    s, _ = h.open(hello())
    o = obs_at(0)
    o[0, 1] = np.inf
    with pytest.raises(SessionError) as err:
        h.observe(s, step(0, o))
    assert str(err.value) == "step 0: observations[1] of env 0 is inf (NaN and infinity are refused)"
    h.close(s, "error")
    assert out == [] and h.metrics.counters["actor/steps_refused_nonfinite_total"] == 1


@pytest.mark.parametrize("policy_keys, declared, column, named", [
    (KEYS, {"pos": (2,), "vel": (1,)}, 1, "observations['pos'][1]"),
    (KEYS, {"pos": (2,), "vel": (1,)}, 2, "observations['vel']"),
    (None, {"a": (1,), "b": (2,)}, 1, "observations['b'][0]"),  # the keys the simulator declared
])
def test_a_dict_observation_names_the_key_at_fault(policy_keys, declared, column, named):
    h, _ = spaced_hub(Discrete(2), obs_keys=policy_keys)
    s, _ = h.open(hello_with(Discrete(2), obs=declared))
    o = obs_at(0)
    o[1, column] = np.nan
    with pytest.raises(SessionError) as err:
        h.observe(s, step(0, o))
    assert err.value.code == "INVALID_ARGUMENT"
    assert str(err.value) == f"step 0: {named} of env 1 is nan (NaN and infinity are refused)"


@pytest.mark.parametrize("check", [False, True], ids=["bounds-off", "bounds-on"])
def test_declared_observation_bounds_are_checked_only_when_asked(check):
    h, out = hub(check_obs_bounds=check)
    msg = hello()
    msg.observation_space.box.low[:] = [-1.0]                 # one bound for every element
    msg.observation_space.box.high[:] = [1.0, 1.0, np.inf]    # the last element has no upper bound
    s, _ = h.open(msg)
    inside = np.array([[1.0, -1.0, 1e30], [0.5, 0.0, -0.5]], np.float32)  # on the bounds, or beyond an infinite one
    h.observe(s, step(0, inside))
    h.record_actions(s, np.array([0, 1]), {"behaviour_logprob": np.zeros(N, np.float32)}, 1)
    outside = inside.copy()
    outside[1, 0] = 1.5
    flags = {"rewards": [0.0, 0.0], "term": [False, False], "trunc": [False, False]}
    if not check:
        h.observe(s, step(1, outside, **flags))
        assert s.t == 1 and h.metrics.counters["actor/steps_refused_out_of_bounds_total"] == 0
        return
    with pytest.raises(SessionError) as err:
        h.observe(s, step(1, outside, **flags))
    assert err.value.code == "INVALID_ARGUMENT"
    assert str(err.value) == ("step 1: observations[0] of env 1 is 1.5, outside its declared bounds [-1, 1] "
                              "(actor.check_obs_bounds)")
    assert h.metrics.counters["actor/steps_refused_out_of_bounds_total"] == 1
    assert h.metrics.counters["actor/steps_refused_nonfinite_total"] == 0 and s.t == 0
    nan = inside.copy()
    nan[0, 2] = np.nan
    s, _ = h.open(hello("other"))  # no bounds declared: NaN is still refused, as non-finite
    with pytest.raises(SessionError) as err:
        h.observe(s, step(0, nan))
    assert "observations[2] of env 0 is nan" in str(err.value)
    assert h.metrics.counters["actor/steps_refused_nonfinite_total"] == 1


def test_dict_bounds_are_each_keys():
    cfg = config_from_dict({"algorithm": "ppo", "env": {"mode": "external"}, "ppo": {"rollout_steps": T},
                            "actor": {"check_obs_bounds": True}})
    h = SessionHub(cfg, EnvSpec((3,), np.dtype(np.float32), Discrete(2), KEYS), "actor-x", Metrics("actor"), [].append)
    msg = hello_with(Discrete(2), obs={"pos": (2,), "vel": (1,)})
    msg.observation_space.dict.spaces["vel"].low[:] = [0.0]
    msg.observation_space.dict.spaces["vel"].high[:] = [3.0]   # "pos" declares none
    s, _ = h.open(msg)
    o = np.array([[-1e9, 1e9, 3.0], [0.0, 0.0, 3.5]], np.float32)
    with pytest.raises(SessionError) as err:
        h.observe(s, step(0, o))
    assert str(err.value) == ("step 0: observations['vel'] of env 1 is 3.5, outside its declared bounds [0, 3] "
                              "(actor.check_obs_bounds)")


def test_malformed_declared_bounds_are_refused_only_when_they_are_checked():
    msg = hello()
    msg.observation_space.box.low[:] = [0.0, 1.0]  # two values for three elements
    h, _ = hub()
    h.open(msg)  # not checked: observation bounds are not read
    h, _ = hub(check_obs_bounds=True)
    with pytest.raises(SessionError) as err:
        h.open(msg)
    assert err.value.code == "INVALID_ARGUMENT"
    assert str(err.value) == "observation_space.box.low: has 2 values: give 0, 1 or 3"
    assert h.metrics.counters["actor/sessions_refused_total"] == 1 and not h.sessions


def test_a_hub_without_a_fragment_sink_refuses_nan_the_same_way():
    """`kuberl serve`: a NaN observation gets INVALID_ARGUMENT, never reaches the policy."""
    cfg = config_from_dict({"algorithm": "ppo", "env": {"mode": "external"}, "ppo": {"rollout_steps": T}})
    h = SessionHub(cfg, SPEC, "serve-x", Metrics("actor"), on_fragment=None)
    s, _ = h.open(hello())
    drive(h, s, steps=1)
    with pytest.raises(SessionError) as err:
        h.observe(s, poisoned(2, "obs", np.nan))
    assert err.value.code == "INVALID_ARGUMENT" and "observations[2] of env 1 is nan" in str(err.value)
    assert h.metrics.counters["actor/steps_refused_nonfinite_total"] == 1


def test_a_recurrent_policys_state_is_kept_per_env_reset_at_episode_ends_recorded_per_fragment_and_resumed():
    """ppo.recurrent: the hub keeps each env copy's state, zeroes it where the simulator reports an
    episode's end (before the next action is chosen), sends each fragment's starting state as
    extras.core_state, and a session resumed under its session_id goes on from the state its last
    actions were chosen from (its step 0 re-sends those observations); a new session_id starts at 0."""
    cfg = config_from_dict({"algorithm": "ppo", "env": {"mode": "external"},
                            "ppo": {"rollout_steps": T, "recurrent": "gru", "recurrent_size": 2}})
    out: list = []
    h = SessionHub(cfg, SPEC, "actor-x", Metrics("actor"), sink(out), state_size=2)
    s, _ = h.open(hello())
    assert s.episodes.state.tolist() == [[0, 0], [0, 0]]
    starts = []
    logp = {"behaviour_logprob": np.zeros(N, np.float32)}
    for k in range(T + 2):
        if k == 0:
            h.observe(s, step(0, obs_at(0)))
        else:
            h.observe(s, step(k, obs_at(k), rewards=[1.0, 1.0], term=[k == 2, False], trunc=[False, False],
                              final=[np.zeros(3)] if k == 2 else None))
        starts.append(s.episodes.state.copy())   # what the next action is chosen from
        h.record_actions(s, np.array([0, 1]), logp, version=1, state=np.full((N, 2), k + 1, np.float32))
    # Env 0's episode ended at step 2: its state was zeroed before step 2's action, env 1's carried on.
    assert starts[2].tolist() == [[0, 0], [2, 2]] and starts[3].tolist() == [[3, 3], [3, 3]]
    frag = decode_fragment(out[0], algorithm=pb.ALGORITHM_PPO, extras=("behaviour_logprob",),
                           start_extras=("core_state",))
    assert frag.extras["core_state"].tolist() == [[0, 0], [0, 0]]
    h.close(s, "error")
    second = decode_fragment(out[1], extras=("behaviour_logprob",), start_extras=("core_state",))
    assert second.extras["core_state"].tolist() == starts[T].tolist() == [[T, T], [T, T]]
    resumed, was = h.open(hello())
    assert was and resumed.episodes.state.tolist() == starts[T + 1].tolist() == [[T + 1] * 2] * 2
    fresh, was = h.open(hello(sid="other"))
    assert not was and not fresh.episodes.state.any()


async def test_serving_refuses_a_policy_offered_under_another_name():
    """`kuberl serve` of several policies: each is served under its own name (its version gauge is
    actor/policies/<name>/policy_version); one offered under another is refused, not renamed."""
    from services.actor.policy import Policy
    from services.actor.serve import serving
    from services.common.envs import spec_of

    cfg = config_from_dict({"algorithm": "ppo", "env": {"id": "CartPole-v1", "mode": "external"}})
    policy = Policy(cfg, spec_of(cfg.env), 0, Metrics("actor"), name="red")
    with pytest.raises(ValueError, match="the policy named 'red' is offered as 'blue'"):
        async with serving({"blue": policy}, cfg, Metrics("actor"), listen="127.0.0.1:0"):
            pass
    assert policy.name == "red"

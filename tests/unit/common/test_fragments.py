"""services/common/protocol/fragments.py: building, validating and decoding TrajectoryFragment messages."""

from __future__ import annotations

import numpy as np
import pytest

from kuberl.v1 import common_pb2 as pb
from services.common.protocol.fragments import MAX_ID_LEN, build_fragment, decode_fragment
from services.common.protocol.tensors import TensorError, decode, encode
from tests.unit.fragment_factory import DQN, PPO, fragment_arrays, make_msg

T, N = 3, 2


def test_ppo_round_trip():
    arrays = fragment_arrays(T, N)
    msg = build_fragment(actor_id="a-1", seq=7, policy_version=5, algorithm=PPO, env_ids=[10, 11], **arrays)
    frag = decode_fragment(msg, algorithm=PPO)
    assert (frag.actor_id, frag.seq, frag.policy_version, frag.algorithm) == ("a-1", 7, 5, PPO)
    assert frag.env_ids == (10, 11)
    assert (frag.num_steps, frag.num_envs, frag.num_samples) == (T, N, T * N)
    assert msg.num_steps == T
    flat = {k: v for k, v in arrays.items() if k != "extras"}
    flat.update({f"extras.{k}": v for k, v in arrays["extras"].items()})
    assert set(frag.extras) == {"behaviour_logprob"}
    for name, arr in flat.items():
        got = frag.extras[name[7:]] if name.startswith("extras.") else getattr(frag, name)
        assert got.dtype == arr.dtype, name
        np.testing.assert_array_equal(got, arr, err_msg=name)
        assert got.flags.writeable is False, name


def test_dqn_round_trip_without_logprob():
    arrays = fragment_arrays(T, N, with_logprob=False)
    msg = build_fragment(actor_id="a", seq=0, policy_version=0, algorithm=DQN, env_ids=range(N), **arrays)
    assert len(msg.extras) == 0
    frag = decode_fragment(msg, algorithm=DQN, extras=())
    assert frag.extras == {}
    np.testing.assert_array_equal(frag.obs, arrays["obs"])
    np.testing.assert_array_equal(frag.actions, arrays["actions"])


def test_build_converts_step_fields_to_wire_dtypes():
    arrays = fragment_arrays(T, N)
    arrays["rewards"] = arrays["rewards"].astype(np.float64)
    arrays["terminated"] = arrays["terminated"].astype(np.uint8)
    arrays["final_index"] = arrays["final_index"].astype(np.int32)
    arrays["extras"]["behaviour_logprob"] = arrays["extras"]["behaviour_logprob"].astype(np.float64)
    frag = decode_fragment(build_fragment(actor_id="a", seq=0, policy_version=0, algorithm=PPO,
                                          env_ids=range(N), **arrays))
    assert frag.rewards.dtype == np.float32
    assert frag.terminated.dtype == np.bool_
    assert frag.final_index.dtype == np.int64
    assert frag.extras["behaviour_logprob"].dtype == np.float32


def test_episode_ending_mid_fragment():
    # env 0 terminates after t=1, env 1 is truncated after t=0.
    frag = decode_fragment(make_msg(T, N, terminated=[(1, 0)], truncated=[(0, 1)]))
    np.testing.assert_array_equal(frag.final_index, [1, 2])  # flat t * N + n, sorted
    assert frag.final_obs.shape == (2, 3)
    np.testing.assert_array_equal(frag.final_obs[0], [-11, -12, -13])
    np.testing.assert_array_equal(frag.final_obs[1], [-21, -22, -23])


def test_next_obs_uses_final_obs_at_done_steps_and_next_row_elsewhere():
    frag = decode_fragment(make_msg(T, N, terminated=[(1, 0)], truncated=[(0, 1)]))
    nxt = frag.next_obs()
    assert nxt.shape == (T, N, 3)
    assert nxt.dtype == frag.obs.dtype
    finals = {1: frag.final_obs[0], 2: frag.final_obs[1]}
    for t in range(T):
        for n in range(N):
            want = finals.get(t * N + n, frag.obs[t + 1, n])
            np.testing.assert_array_equal(nxt[t, n], want, err_msg=f"t={t} n={n}")


def test_next_obs_final_index_order_need_not_be_sorted():
    arrays = fragment_arrays(T, N, terminated=[(0, 0), (2, 1)])
    arrays["final_index"] = arrays["final_index"][::-1].copy()
    arrays["final_obs"] = arrays["final_obs"][::-1].copy()
    frag = decode_fragment(build_fragment(actor_id="a", seq=0, policy_version=0, algorithm=PPO,
                                          env_ids=range(N), **arrays))
    nxt = frag.next_obs()
    np.testing.assert_array_equal(nxt[0, 0], [-1, -2, -3])
    np.testing.assert_array_equal(nxt[2, 1], [-51, -52, -53])


def test_next_obs_without_dones_is_obs_shifted_and_writable():
    frag = decode_fragment(make_msg(T, N))
    nxt = frag.next_obs()
    np.testing.assert_array_equal(nxt, frag.obs[1:])
    nxt[...] = 0  # a fresh copy: the decoded (read-only) fragment is untouched
    assert frag.obs[1:].any()


def test_next_obs_with_scalar_observations():
    frag = decode_fragment(make_msg(T, N, obs_shape=(), terminated=[(2, 1)]))
    nxt = frag.next_obs()
    assert nxt.shape == (T, N)
    assert nxt[2, 1] == frag.final_obs[0]
    assert nxt[0, 0] == frag.obs[1, 0]


# --- rejections ---------------------------------------------------------------------------------

def good(**kw) -> pb.TrajectoryFragment:
    return make_msg(T, N, terminated=[(1, 0)], truncated=[(2, 1)], **kw)


def reject(msg: pb.TrajectoryFragment, field: str, match: str, **kw) -> None:
    with pytest.raises(TensorError, match=match) as e:
        decode_fragment(msg, **kw)
    assert e.value.field.startswith(field), e.value.field


def test_good_fragment_is_accepted():
    assert decode_fragment(good()).num_samples == T * N


def test_rejects_empty_actor_id():
    reject(good(actor_id=""), "actor_id", "1..128 characters")


def test_actor_id_length_limit():
    assert decode_fragment(good(actor_id="a" * MAX_ID_LEN)).actor_id == "a" * MAX_ID_LEN
    reject(good(actor_id="a" * (MAX_ID_LEN + 1)), "actor_id", "1..128 characters")


def test_rejects_unspecified_algorithm():
    msg = good()
    msg.algorithm = pb.ALGORITHM_UNSPECIFIED
    reject(msg, "algorithm", "unknown or unspecified algorithm 0")


def test_rejects_algorithm_mismatch():
    reject(good(), "algorithm", "fragment is for ppo but this receiver serves dqn", algorithm=DQN)


def test_rejects_zero_num_steps():
    msg = good()
    msg.num_steps = 0
    reject(msg, "num_steps", "0 is outside 1..65536")


def test_rejects_no_env_ids():
    msg = good()
    msg.ClearField("env_ids")
    reject(msg, "env_ids", "at least one env")


def test_rejects_num_steps_disagreeing_with_tensors():
    msg = good()
    msg.num_steps = T + 1
    reject(msg, "obs.shape", r"must start with \[T\+1=5, N=2\], got \[4, 2, 3\]")


def test_rejects_obs_with_wrong_leading_shape():
    msg = good()
    msg.obs.CopyFrom(encode(np.zeros((T, N, 3), np.float32)))
    reject(msg, "obs.shape", r"got \[3, 2, 3\]")


def test_rejects_obs_of_rank_one():
    msg = good()
    msg.obs.CopyFrom(encode(np.zeros(T + 1, np.float32)))
    reject(msg, "obs.shape", "must start with")


def test_rejects_actions_with_wrong_shape():
    msg = good()
    msg.actions.CopyFrom(encode(np.zeros((T, N + 1), np.int64)))
    reject(msg, "actions.shape", r"must start with \[T=3, N=2\], got \[3, 3\]")


def test_rejects_float64_rewards():
    msg = good()
    msg.rewards.CopyFrom(encode(np.zeros((T, N), np.float64)))
    reject(msg, "rewards.dtype", "must be float32, got float64")


def test_rejects_rewards_with_wrong_shape():
    msg = good()
    msg.rewards.CopyFrom(encode(np.zeros((T, N, 1), np.float32)))
    reject(msg, "rewards.shape", r"must be \[T=3, N=2\]")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_rejects_non_finite_rewards(bad):
    msg = good()
    rewards = np.zeros((T, N), np.float32)
    rewards[1, 1] = bad
    msg.rewards.CopyFrom(encode(rewards))
    reject(msg, "rewards", "NaN or infinity")


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("field", ["obs", "final_obs", "actions", "extras.behaviour_logprob"])
def test_rejects_non_finite_observations_actions_and_logprobs(field, bad):
    """Whoever sends them (an actor of another build, a client of its own), NaN and infinity are
    refused where they arrive, naming the field: stored, they would be sampled into batch after batch."""
    msg = good()
    tensor = msg.extras[field.removeprefix("extras.")] if field.startswith("extras.") else getattr(msg, field)
    arr = decode(tensor, field).copy()
    if field == "actions":
        arr = np.zeros((T, N, 2), np.float32)   # a continuous action
    arr.reshape(-1)[-1] = bad
    tensor.CopyFrom(encode(arr))
    reject(msg, field, f"1 of its {arr.size} values are NaN or infinite")


def test_integer_frames_cannot_hold_nan_and_pass():
    assert decode_fragment(good(obs_dtype=np.uint8)).obs.dtype == np.uint8


@pytest.mark.parametrize("name", ["terminated", "truncated"])
def test_rejects_non_bool_done_flags(name):
    msg = good()
    getattr(msg, name).CopyFrom(encode(np.zeros((T, N), np.uint8)))
    reject(msg, f"{name}.dtype", "must be bool, got uint8")


def test_rejects_final_index_missing_a_done_step():
    msg = good()  # done steps: flat 2 (t=1, n=0) and 5 (t=2, n=1)
    msg.final_index.CopyFrom(encode(np.array([2], np.int64)))
    msg.final_obs.CopyFrom(encode(np.zeros((1, 3), np.float32)))
    reject(msg, "final_index", "each of the 2 steps that ended an episode exactly once")


def test_rejects_final_index_listing_a_non_done_step():
    msg = good()
    msg.final_index.CopyFrom(encode(np.array([2, 4], np.int64)))
    reject(msg, "final_index", "exactly once")


def test_rejects_final_index_listing_a_step_twice():
    msg = good()
    msg.final_index.CopyFrom(encode(np.array([2, 2], np.int64)))
    reject(msg, "final_index", "exactly once")


def test_rejects_final_index_of_wrong_dtype():
    msg = good()
    msg.final_index.CopyFrom(encode(np.array([2, 5], np.int32)))
    reject(msg, "final_index", "1-d int64 tensor, got int32")


def test_rejects_final_obs_with_wrong_shape():
    msg = good()
    msg.final_obs.CopyFrom(encode(np.zeros((2, 4), np.float32)))
    reject(msg, "final_obs", r"\[K=2, \*obs_shape=\[3\]\], got float32 \[2, 4\]")


def test_rejects_final_obs_with_wrong_count():
    msg = good()
    msg.final_obs.CopyFrom(encode(np.zeros((1, 3), np.float32)))
    reject(msg, "final_obs", r"got float32 \[1, 3\]")


def test_rejects_final_obs_of_other_dtype_than_obs():
    msg = good()
    msg.final_obs.CopyFrom(encode(np.zeros((2, 3), np.float64)))
    reject(msg, "final_obs", "must be float32")


def test_rejects_ppo_fragment_without_behaviour_logprob():
    """A receiver names the extras its algorithm needs (the buffer passes its algorithm's
    `fragment_extras`); a fragment without one is refused naming it."""
    msg = good()
    msg.ClearField("extras")
    reject(msg, "extras.behaviour_logprob", "required but missing", algorithm=PPO, extras=("behaviour_logprob",))
    assert decode_fragment(msg).extras == {}   # no extras required: none checked for


def test_an_extra_the_algorithm_does_not_declare_is_refused_naming_it():
    msg = good()
    msg.extras["hidden_state"].CopyFrom(encode(np.zeros((T, N), np.float32)))
    reject(msg, "extras.hidden_state", r"is not a field of ppo fragments \(it takes behaviour_logprob\)",
           algorithm=PPO, extras=("behaviour_logprob",))
    assert set(decode_fragment(msg).extras) == {"behaviour_logprob", "hidden_state"}   # none declared: any taken


def test_extras_keep_trailing_dimensions():
    msg = good()
    state = np.arange(T * N * 4, dtype=np.float32).reshape(T, N, 4)
    msg.extras["state"].CopyFrom(encode(state))
    np.testing.assert_array_equal(decode_fragment(msg).extras["state"], state)


def test_rejects_behaviour_logprob_of_wrong_shape():
    msg = good()
    msg.extras["behaviour_logprob"].CopyFrom(encode(np.zeros(T * N, np.float32)))
    reject(msg, "extras.behaviour_logprob", "must be float32")


@pytest.mark.parametrize("name", ["obs", "actions", "rewards", "terminated", "truncated", "final_obs",
                                  "final_index"])
def test_rejects_missing_required_tensor(name):
    msg = good()
    msg.ClearField(name)
    reject(msg, name, "required but missing")


def test_rejects_malformed_tensor_naming_the_nested_field():
    msg = good()
    msg.obs.data = msg.obs.data[:-1]
    reject(msg, "obs.data", "bytes but shape")


def test_max_elements_is_applied_to_each_tensor():
    reject(good(), "obs.shape", "elements exceed the limit of 10", max_elements=10)

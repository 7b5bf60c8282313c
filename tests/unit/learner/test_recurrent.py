"""Recurrent PPO (ppo.recurrent): the core's state across episode ends, the learner's sequence replay
against a naive per-step loop, and the actor's recorded state against the learner's replay of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kuberl_envs  # noqa: F401 - registers CartPoleNoVelocity-v1
from kuberl.v1 import common_pb2 as pb
from services.actor.rollout import Rollout
from services.algorithms.ppo.config import PPOConfig
from services.algorithms.ppo.learner import PPO, Sequences
from services.algorithms.ppo.networks import RecurrentActorCritic
from services.common.models.nets import env_spec, to_numpy
from services.common.protocol.fragments import Fragment, RawFragment, build_fragment, decode_fragment
from services.common.protocol.tensors import TensorError
from services.common.settings import ConfigError
from services.common.stats import Metrics
from services.config import config_from_dict

SPEC = env_spec("kuberl_envs:CartPoleNoVelocity-v1")


def net(core: str, separate: bool = False) -> RecurrentActorCritic:
    torch.manual_seed(0)
    return RecurrentActorCritic(SPEC, (16,), core, 8, separate_critic=separate)


CORES = pytest.mark.parametrize("core, critic", [("lstm", "shared"), ("gru", "shared"), ("lstm", "separate")])


@CORES
def test_a_reset_inside_a_sequence_starts_the_state_afresh(core, critic):
    """Replaying [T, B] with a reset at step 3 of column 0 gives, from step 3 on, exactly what a fresh
    sequence from the zero state gives; column 1 (no reset) carries its state through."""
    m = net(core, critic == "separate")
    assert m.state_size == 8 * (2 if core == "lstm" else 1) * (2 if critic == "separate" else 1)
    obs = torch.randn(6, 2, 2)
    state = torch.randn(2, m.state_size)
    resets = torch.zeros(6, 2, dtype=torch.bool)
    resets[3, 0] = True
    out, ends = m.unroll(obs, state, resets)
    fresh, _ = m.unroll(obs[3:, :1], m.initial_state(1), torch.zeros(3, 1, dtype=torch.bool))
    torch.testing.assert_close(out[3:, :1], fresh)
    carried, _ = m.unroll(obs[:, 1:], state[1:], torch.zeros(6, 1, dtype=torch.bool))
    torch.testing.assert_close(out[:, 1:], carried)
    assert not torch.allclose(out[3:, :1], m.unroll(obs[:, :1], state[:1], torch.zeros(6, 1, dtype=torch.bool))[0][3:])
    # A step-by-step loop (the cell's equations, as actors run them) gives the same outputs, and the
    # state after each piece's last step (column 0: steps 2 and 5; column 1: step 5), zeros elsewhere.
    s = state.clone()
    piece_ends = {(2, 0), (5, 0), (5, 1)}
    for t in range(6):
        s = s * (~resets[t]).unsqueeze(-1)
        h, s = m.step(obs[t], s)
        torch.testing.assert_close(out[t], h)
        for b in range(2):
            torch.testing.assert_close(ends[t, b], s[b] if (t, b) in piece_ends else torch.zeros_like(s[b]))


def fragment(T: int, N: int, state_size: int, seed: int, ends: list[tuple[int, int, bool]]) -> Fragment:
    """A random PPO fragment with episode ends at (t, n, truncated) and random starting states."""
    rng = np.random.default_rng(seed)
    term, trunc = np.zeros((T, N), bool), np.zeros((T, N), bool)
    for t, n, truncated in ends:
        (trunc if truncated else term)[t, n] = True
    final_index = np.flatnonzero((term | trunc).reshape(-1)).astype(np.int64)
    msg = build_fragment(
        actor_id="a", seq=seed, policy_version=0, algorithm=pb.ALGORITHM_PPO, env_ids=range(N),
        obs=rng.normal(size=(T + 1, N, 2)).astype(np.float32), actions=rng.integers(0, 2, (T, N)),
        rewards=rng.normal(size=(T, N)).astype(np.float32), terminated=term, truncated=trunc,
        final_obs=rng.normal(size=(len(final_index), 2)).astype(np.float32), final_index=final_index,
        extras={"behaviour_logprob": np.full((T, N), np.log(0.5), np.float32),
                "core_state": rng.normal(size=(N, state_size)).astype(np.float32)})
    return decode_fragment(msg, extras=("behaviour_logprob",), start_extras=("core_state",))


@CORES
def test_sequence_minibatches_give_the_log_probs_and_values_of_a_naive_per_step_loop(core, critic):
    """Two fragments of different lengths, episode ends inside them: `Sequences.replay` of any subset
    of sequences gives, row for row, the log-probs and values of stepping each env one step at a time
    from its recorded state, zeroing it after each end."""
    learner = PPO(PPOConfig(recurrent=core, recurrent_size=8, hidden_sizes=(16,), batch_steps=8, critic_core=critic),
                  SPEC)
    frags = [fragment(5, 3, learner.net.state_size, 1, [(1, 0, False), (3, 2, True)]),
             fragment(4, 2, learner.net.state_size, 2, [(0, 1, False)])]
    parts = [learner._advantages(f, False) for f in frags]
    obs = torch.cat([p[0] for p in parts])
    actions = torch.cat([learner._actions(f) for f in frags])
    data = (obs, *(torch.zeros(len(obs)),) * 3, actions, torch.zeros(len(obs)), None, None)
    seqs = Sequences(frags, learner.device)
    assert seqs.count == 5
    # The naive loop, per row (t * N + n, fragment after fragment).
    m = learner.net
    logp, values = [], []
    with torch.no_grad():
        for f in frags:
            state = torch.tensor(f.extras["core_state"])
            done = f.terminated | f.truncated
            for t in range(f.num_steps):
                if t:
                    state = state * torch.tensor(~done[t - 1]).unsqueeze(-1)
                out, state = m.step(torch.tensor(f.obs[t]), state)
                dist, v = m.heads(out)
                logp.append(dist.log_prob(torch.tensor(f.actions[t])))
                values.append(v)
    logp, values = torch.cat(logp), torch.cat(values)
    for mb in (torch.arange(5), torch.tensor([4, 0]), torch.tensor([2])):
        with torch.no_grad():
            rows, dist, value = seqs.replay(m, data, mb)
        assert len(rows) == sum(frags[0 if i < 3 else 1].num_steps for i in mb.tolist())
        torch.testing.assert_close(dist.log_prob(actions[rows]), logp[rows])
        torch.testing.assert_close(value, values[rows])
    # The values the update starts from are the same loop's.
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), values)


def test_the_truncation_bootstrap_reads_the_final_observation_from_the_state_before_the_reset():
    learner = PPO(PPOConfig(recurrent="gru", recurrent_size=8, hidden_sizes=(16,), batch_steps=8, gamma=0.9,
                            gae_lambda=0.0, normalize_rewards=False), SPEC)
    f = fragment(3, 1, learner.net.state_size, 3, [(1, 0, True)])
    m = learner.net
    with torch.no_grad():
        state = torch.tensor(f.extras["core_state"])
        for t in range(2):
            out, state = m.step(torch.tensor(f.obs[t]), state)
        v_t1 = m.heads(out)[1]
        v_final = m.value_after(torch.tensor(f.final_obs), state)
        _, values, adv, _, _, _ = learner._advantages(f, False)
    # gae_lambda 0: the advantage at the truncated step is r + gamma V(final obs) - V(obs[1])
    torch.testing.assert_close(adv[1:2], torch.tensor(f.rewards[1]) + 0.9 * v_final - v_t1)
    torch.testing.assert_close(values[1:2], v_t1)


@pytest.mark.parametrize("core", ["lstm", "gru"])
def test_an_update_on_sequences_trains_and_moves_the_weights(core):
    learner = PPO(PPOConfig(recurrent=core, recurrent_size=8, hidden_sizes=(16,), batch_steps=8, num_minibatches=2,
                            num_epochs=2), SPEC)
    before = {k: v.clone() for k, v in learner.net.state_dict().items()}
    out = learner.update([fragment(6, 4, learner.net.state_size, 4, [(2, 1, False)])])
    assert learner.version == 1 and learner.gradient_steps == 4 and np.isfinite(out["policy_loss"])
    assert not torch.equal(before["core.weight_hh_l0"], learner.net.state_dict()["core.weight_hh_l0"])


@pytest.mark.parametrize("env_id, core, critic", [("kuberl_envs:CartPoleNoVelocity-v1", "lstm", "shared"),
                                                   ("kuberl_envs:CartPoleNoVelocity-v1", "gru", "separate"),
                                                   ("kuberl_envs:MaskedChoice-v0", "gru", "shared"),
                                                   ("Pendulum-v1", "lstm", "shared")],
                         ids=["discrete", "discrete-separate-critic", "multidiscrete-masked", "box"])
def test_the_actors_recorded_state_is_what_the_learner_replays_from(env_id, core, critic):
    """Two consecutive fragments of a real rollout (episodes end inside them on CartPole and
    MaskedChoice; Pendulum's state runs across the fragment boundary): with the actor's weights, the
    learner's replay of each fragment from its recorded core_state gives back the behaviour
    log-probs the actor recorded, so state carried across fragments and reset at episode ends (and
    the masks, and a Box's unclipped samples) are the same on both sides."""
    cfg = config_from_dict({"algorithm": "ppo", "env": {"id": env_id, "num_envs": 3},
                            "ppo": {"rollout_steps": 40, "batch_steps": 40, "recurrent": core, "recurrent_size": 8,
                                    "hidden_sizes": [16], "critic_core": critic}})
    rollout = Rollout(cfg, "actor-r", 0, Metrics("actor"))
    learner = PPO(cfg.section("ppo"), rollout.spec)
    with torch.no_grad():
        learner.net.actor.weight.mul_(30.0)   # a policy far from uniform: log-probs that depend on the state
    rollout.policy.offer_weights(0, to_numpy(learner.net))
    try:
        frags = [decode_fragment(RawFragment(rollout.collect().payload), extras=("behaviour_logprob",),
                                 start_extras=("core_state",)) for _ in range(2)]
    finally:
        rollout.close()
    if env_id != "Pendulum-v1":
        assert (frags[0].terminated | frags[0].truncated).any(), "episodes end within 40 steps"
    assert not np.any(frags[0].extras["core_state"]), "the first fragment starts every env afresh"
    assert np.any(frags[1].extras["core_state"])
    for f in frags:
        mask = None if f.action_mask is None else torch.tensor(f.action_mask).reshape(f.num_samples, -1)
        _, _, _, _, current, weights = learner._advantages(f, False, mask)
        np.testing.assert_allclose(current.numpy(), f.extras["behaviour_logprob"].reshape(-1), atol=1e-4)
        np.testing.assert_allclose(weights.numpy(), 1.0, atol=1e-3)
    if env_id == "kuberl_envs:MaskedChoice-v0":
        assert all(f.action_mask is not None for f in frags)
        out = learner.update(frags)
        assert learner.version == 1 and np.isfinite(out["policy_loss"])


def test_a_fragment_without_or_with_a_misshapen_state_is_refused_naming_it():
    learner = PPO(PPOConfig(recurrent="lstm", recurrent_size=8, hidden_sizes=(16,), batch_steps=8), SPEC)
    f = fragment(3, 2, 5, 5, [])
    batch = pb.TrainingBatch()
    batch.rollouts.fragments.append(build_fragment(
        actor_id="a", seq=0, policy_version=0, algorithm=pb.ALGORITHM_PPO, env_ids=range(2), obs=f.obs,
        actions=f.actions, rewards=f.rewards, terminated=f.terminated, truncated=f.truncated, final_obs=f.final_obs,
        final_index=f.final_index, extras={"behaviour_logprob": f.extras["behaviour_logprob"],
                                           "core_state": f.extras["core_state"]}))
    with pytest.raises(TensorError, match=r"extras.core_state: must be \[N=2, 16\]"):
        learner.decode(batch)
    del batch.rollouts.fragments[0].extras["core_state"]
    with pytest.raises(TensorError, match="extras.core_state: is required but missing"):
        learner.decode(batch)
    feed_forward = PPO(PPOConfig(hidden_sizes=(16,), batch_steps=8), SPEC)
    batch.rollouts.fragments[0].extras["core_state"].CopyFrom(batch.rollouts.fragments[0].extras["behaviour_logprob"])
    with pytest.raises(TensorError, match="extras.core_state: is not a field of ppo fragments"):
        feed_forward.decode(batch)


@pytest.mark.parametrize("value, message", [("rnn", "must be 'lstm', 'gru' or null"), ("lstm", None)])
def test_the_recurrent_setting_is_checked_as_the_config_loads(value, message):
    if message is None:
        assert PPOConfig(recurrent=value).recurrent == "lstm"
        return
    with pytest.raises(ConfigError, match=message):
        PPOConfig(recurrent=value)

"""services/algorithms/sac: the losses against a naive transcription of Haarnoja et al. (2018) on known
numbers, the tanh log-prob correction against torch.distributions, and SAC.update's steps."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from torch.distributions import AffineTransform, Normal, TanhTransform, TransformedDistribution

from services.algorithms.sac.acting import Acting
from services.algorithms.sac.learner import SAC, actor_loss, alpha_loss, critic_target
from services.algorithms.sac.networks import SquashedGaussianActor, squashed_log_prob
from services.algorithms.sac.config import SACConfig
from services.config import config_from_dict
from services.common.envs import EnvSpec
from services.common.protocol.spaces import Box
from services.common.stats import Metrics
from services.common.protocol.tensors import encode
from tests.unit.fragment_factory import transition_batch as wire_transitions
from tests.unit.learner.test_losses import params

SPEC = EnvSpec(obs_shape=(3,), obs_dtype=np.dtype(np.float32), action=Box.of((2,), [-2.0, 0.0], [2.0, 1.0]))


# --- the losses, on known numbers -----------------------------------------------------------------

def test_critic_target_takes_the_smaller_q_and_the_entropy_bonus():
    rewards = torch.tensor([1.0, -0.5, 2.0])
    terminated = torch.tensor([False, False, True])
    q1, q2 = torch.tensor([3.0, 1.0, 9.0]), torch.tensor([2.0, 4.0, 9.0])
    logp = torch.tensor([-1.0, 0.5, 7.0])
    y = critic_target(rewards, terminated, q1, q2, logp, alpha=0.2, gamma=0.9)
    # row 0: min(3, 2) = 2, minus 0.2 * -1 -> 2.2; row 1: min 1, minus 0.2 * 0.5 -> 0.9; row 2: terminal
    want = [1.0 + 0.9 * 2.2, -0.5 + 0.9 * 0.9, 2.0]
    torch.testing.assert_close(y, torch.tensor(want))
    naive = [r + (0.0 if d else 0.9 * (min(a, b) - 0.2 * lp))
             for r, d, a, b, lp in zip(rewards.tolist(), terminated.tolist(), q1.tolist(), q2.tolist(), logp.tolist())]
    torch.testing.assert_close(y, torch.tensor(naive))


def test_actor_loss_is_alpha_logp_minus_min_q():
    logp = torch.tensor([-1.0, 0.5])
    q1, q2 = torch.tensor([3.0, 1.0]), torch.tensor([2.0, 4.0])
    # (0.5 * -1 - 2 + 0.5 * 0.5 - 1) / 2
    assert actor_loss(logp, q1, q2, 0.5).item() == pytest.approx((-0.5 - 2.0 + 0.25 - 1.0) / 2)


def test_alpha_loss_and_its_gradient_push_entropy_to_the_target():
    log_alpha = torch.tensor(math.log(0.3), requires_grad=True)
    logp = torch.tensor([-1.0, 0.5], requires_grad=True)
    loss = alpha_loss(log_alpha, logp, target_entropy=-2.0)
    assert loss.item() == pytest.approx(-0.3 * ((-1.0 - 2.0) + (0.5 - 2.0)) / 2)
    loss.backward()
    assert logp.grad is None  # the temperature's loss never moves the policy
    # entropy (1 - 0.5... = mean -logp = 0.25) is above the target (-2): alpha goes down
    assert log_alpha.grad.item() > 0


# --- the squashed Gaussian ------------------------------------------------------------------------

def test_squashed_log_prob_matches_a_transformed_normal():
    mean = torch.tensor([[0.3, -1.2], [2.0, 0.0]])
    std = torch.tensor([[0.5, 1.5], [0.1, 2.0]])
    scale, bias = torch.tensor([2.0, 0.5]), torch.tensor([0.0, 0.5])
    normal = Normal(mean, std)
    u = torch.tensor([[0.7, -2.5], [1.9, 0.4]])
    ref = TransformedDistribution(Normal(mean, std), [TanhTransform(), AffineTransform(bias, scale)])
    action = torch.tanh(u) * scale + bias
    torch.testing.assert_close(squashed_log_prob(normal, u, scale), ref.log_prob(action).sum(-1))


def test_squashed_log_prob_stays_finite_where_tanh_saturates():
    normal = Normal(torch.zeros(1, 1), torch.ones(1, 1))
    u = torch.tensor([[30.0]])  # tanh(30) rounds to 1 in float32: log(1 - tanh^2) would be -inf
    got = squashed_log_prob(normal, u, torch.ones(1))
    want = normal.log_prob(u).sum() - 2 * (math.log(2) - 30.0 - math.log1p(math.exp(-60.0)))
    assert torch.isfinite(got).all() and got.item() == pytest.approx(want.item(), rel=1e-5)


def test_actions_lie_within_the_bounds_and_carry_their_log_prob():
    torch.manual_seed(0)
    actor = SquashedGaussianActor(SPEC, (16,))
    with torch.no_grad():
        actor.net[-1].bias.fill_(3.0)  # large means and stds: many samples near the bounds
    action, logp = actor.sample(torch.randn(512, 3))
    low, high = torch.tensor([-2.0, 0.0]), torch.tensor([2.0, 1.0])
    assert action.shape == (512, 2) and logp.shape == (512,)
    assert ((action >= low) & (action <= high)).all() and torch.isfinite(logp).all()
    mode = actor.mode(torch.zeros(1, 3))
    assert ((mode >= low) & (mode <= high)).all()


def test_acting_is_uniform_until_the_first_update_then_follows_the_policy():
    cfg = config_from_dict({"algorithm": "sac", "env": {"id": "Pendulum-v1"}, "sac": {"hidden_sizes": [8]}})
    acting = Acting(cfg, SPEC, np.random.default_rng(0), Metrics("actor"))
    obs = torch.zeros(4000, 3)
    for version in (None, 0):
        actions, extras = acting.act(obs, version, 0)
        assert actions.dtype == np.float32 and actions.shape == (4000, 2) and extras == {}
        # uniform over [-2, 2] x [0, 1]: means near the centres, spread over the whole range
        assert np.allclose(actions.mean(0), [0.0, 0.5], atol=0.06)
        assert actions[:, 0].min() < -1.9 and actions[:, 0].max() > 1.9
    actions, _ = acting.act(obs, 1, 0)  # untrained weights: a narrow Gaussian around the centre
    assert actions[:, 0].std() < 1.0 and (actions[:, 1] >= 0).all() and (actions[:, 1] <= 1).all()


# --- SAC.update -----------------------------------------------------------------------------------

def sac_cfg(**kw) -> SACConfig:
    return SACConfig(**{"hidden_sizes": (8,), "batch_size": 4, "learning_starts": 4, "buffer_size": 16, **kw})


def transition_batch(B: int = 6, seed: int = 0) -> dict[str, np.ndarray]:
    return wire_transitions(lambda rng, n: rng.uniform(-1, 1, (n, 2)).astype(np.float32), 3, B, seed)


def test_one_update_moves_critic_actor_alpha_and_targets_by_polyak():
    torch.manual_seed(0)
    sac = SAC(sac_cfg(tau=0.25), SPEC)
    critic0, actor0, target0 = params(sac.critic), params(sac.actor), params(sac.target)
    alpha0 = sac.log_alpha.item()
    samples, stats = sac.learn(transition_batch())
    assert samples == 6 and sac.version == 1 and sac.gradient_steps == 1
    assert {"q_loss", "q_mean", "pi_loss", "entropy", "alpha"} <= set(stats)
    assert all(not torch.equal(a, b) for a, b in zip(critic0, params(sac.critic)))
    assert any(not torch.equal(a, b) for a, b in zip(actor0, params(sac.actor)))
    assert sac.log_alpha.item() != alpha0
    for t0, t1, c1 in zip(target0, params(sac.target), params(sac.critic)):
        torch.testing.assert_close(t1, 0.75 * t0 + 0.25 * c1)


def test_without_autotune_alpha_stays_and_the_policy_loss_leaves_the_critic_alone():
    torch.manual_seed(0)
    sac = SAC(sac_cfg(autotune=False, alpha=0.05), SPEC)
    batch = {k: v for k, v in transition_batch().items() if k != "policy_version"}
    sac.update(batch)
    assert sac.log_alpha.item() == pytest.approx(math.log(0.05))
    assert all(p.requires_grad for p in sac.critic.parameters())
    assert all(not p.requires_grad for p in sac.target.parameters())


def test_state_dict_round_trip_and_the_policy_is_the_actor_alone():
    torch.manual_seed(0)
    a = SAC(sac_cfg(), SPEC)
    for seed in range(3):
        a.learn(transition_batch(seed=seed))
    b = SAC(sac_cfg(), SPEC)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as from a checkpoint: no tensor shared with a
    assert b.version == 3 and b.log_alpha.item() == a.log_alpha.item()
    batch = transition_batch(seed=9)
    torch.manual_seed(1)
    sa = a.learn(batch)[1]
    torch.manual_seed(1)
    sb = b.learn(batch)[1]
    assert sa == sb
    assert set(a.policy.state_dict()) == set(SquashedGaussianActor(SPEC, (8,)).state_dict())


def test_batches_that_do_not_fit_the_env_are_refused_naming_the_field():
    sac = SAC(sac_cfg(), SPEC)
    from kuberl.v1 import common_pb2 as pb
    good = transition_batch()
    for field, bad in (("actions", good["actions"][:, :1]), ("obs", good["obs"][:, :2]),
                       ("rewards", good["rewards"][:3]), ("actions", good["actions"].astype(np.float64))):
        arrays = {**good, field: np.ascontiguousarray(bad)}
        batch = pb.TrainingBatch(transitions=pb.TransitionBatch(**{k: encode(v) for k, v in arrays.items()}))
        with pytest.raises(ValueError, match=field):
            sac.decode(batch)


def test_sac_refuses_spaces_it_cannot_act_in():
    from services import algorithms
    from services.common.protocol.spaces import Discrete
    sac = algorithms.get("sac")
    with pytest.raises(ValueError, match="sac takes Box actions"):
        sac.check_spec(EnvSpec((3,), np.dtype(np.float32), Discrete(2)))
    big = float(np.finfo(np.float32).max)  # gymnasium's usual "unbounded": the width overflows float32
    for box in (Box.of((1,), -np.inf, 1.0), Box.of((2,), -big, big), Box.of((2,), [0.0, 1.0], [1.0, 1.0])):
        with pytest.raises(ValueError, match="finite in float32 with low < high"):
            sac.check_spec(EnvSpec((3,), np.dtype(np.float32), box))
    with pytest.raises(ValueError, match="flat observations"):
        sac.check_spec(EnvSpec((4, 84, 84), np.dtype(np.uint8), Box.of((1,), -1.0, 1.0)))


@pytest.mark.parametrize("key, value", [("target_entropy", float("nan")), ("alpha", float("inf")),
                                        ("q_lr", 0.0)])
def test_sac_settings_that_would_poison_the_weights_are_refused_naming_the_key(key, value):
    from services.common.config import ConfigError
    with pytest.raises(ConfigError, match=f"sac.{key}"):
        config_from_dict({"algorithm": "sac", "sac": {key: value}})

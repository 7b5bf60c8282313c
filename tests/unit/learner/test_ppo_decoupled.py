"""ppo.decoupled: the decoupled clipped objective (Hilton et al. 2021, "Batch size-invariance for
policy optimization"). The clip is centred on the policy at the start of the update (pi_prox) and each
sample's term is weighted by pi_prox / mu, truncated; on-policy data trains exactly as plain PPO, and
data acted by an older policy (an asynchronous actor one or more updates behind) does not start its
update outside the clip range."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from services.algorithms.ppo.config import PPOConfig
from services.algorithms.ppo.learner import PPO
from services.common.models.nets import EnvSpec
from services.common.protocol.spaces import Discrete
from services.config import ConfigError, config_from_dict
from tests.unit.fragment_factory import make_fragment

SPEC = EnvSpec(obs_shape=(3,), obs_dtype=np.float32, action=Discrete(2))


def learner(**kw) -> PPO:
    torch.manual_seed(0)
    cfg = PPOConfig(**{"hidden_sizes": (8,), "num_epochs": 2, "num_minibatches": 2, "batch_steps": 8,
                       "learning_rate": 0.01, **kw})
    return PPO(cfg, SPEC)


def current_logprob(ppo: PPO, frag) -> torch.Tensor:
    with torch.no_grad():
        obs = torch.tensor(frag.obs[:-1]).flatten(0, 1)
        return ppo.net.dist(obs).log_prob(torch.tensor(frag.actions).reshape(-1))


def with_behaviour(frag, logprob: np.ndarray):
    return dataclasses.replace(frag, extras={"behaviour_logprob": logprob.astype(np.float32).reshape(frag.rewards.shape)})


def test_on_policy_data_trains_exactly_as_plain_ppo():
    """mu = pi_prox: weights 1 and the same ratios, so the same gradient steps, bit for bit."""
    plain, decoupled = learner(decoupled=False), learner(decoupled=True)
    frag = make_fragment(T=4, N=2, terminated=[(1, 0)], truncated=[(3, 1)])
    frag = with_behaviour(frag, current_logprob(plain, frag).numpy())
    torch.manual_seed(1)
    plain.update([frag])
    torch.manual_seed(1)
    decoupled.update([frag])
    for a, b in zip(plain.net.parameters(), decoupled.net.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_the_clip_is_centred_on_the_current_policy_and_the_weight_is_pi_over_mu_truncated():
    ppo = learner(decoupled=True, decoupled_rho_bar=1.5)
    frag = make_fragment(T=4, N=2)
    now = current_logprob(ppo, frag)
    shift = torch.tensor([-1.0, -0.2, 0.0, 0.1, 0.3, 0.6, 1.0, 2.0])   # log pi_prox - log mu per sample
    frag = with_behaviour(frag, (now - shift).numpy())
    *_, anchor, weights = ppo._advantages(frag, correct=False)
    torch.testing.assert_close(anchor, now)
    assert weights is not None
    torch.testing.assert_close(weights, shift.exp().clamp(max=1.5))
    # A fragment V-trace corrects has its rho in the advantages already: weights 1, the clip still on pi_prox.
    *_, anchor, weights = ppo._advantages(frag, correct=True)
    torch.testing.assert_close(anchor, now)
    assert weights is not None
    torch.testing.assert_close(weights, torch.ones(8))


def test_stale_data_starts_inside_the_clip_only_when_decoupled():
    """A fragment acted by a policy far from the current one: plain PPO's first ratios (against mu)
    are already clipped; the decoupled ones (against pi_prox) all start at 1."""
    frag = make_fragment(T=4, N=2)
    for decoupled, clipped in ((False, True), (True, False)):
        ppo = learner(decoupled=decoupled, num_epochs=1, num_minibatches=1)
        behaviour = current_logprob(ppo, frag) - torch.tensor([1.0, -1.0] * 4)   # ratios e and 1/e
        stats = ppo.update([with_behaviour(frag, behaviour.numpy())])
        assert (stats["clipfrac"] == 1.0) is clipped and (stats["approx_kl"] == pytest.approx(0.0, abs=1e-6)) is not clipped


def test_the_settings_are_checked():
    with pytest.raises(ConfigError, match="decoupled_rho_bar"):
        config_from_dict({"algorithm": "ppo", "ppo": {"decoupled": True, "decoupled_rho_bar": 0}})
    assert config_from_dict({"algorithm": "ppo"}).section("ppo").decoupled is True   # the default
    assert config_from_dict({"algorithm": "ppo", "ppo": {"decoupled": False}}).section("ppo").decoupled is False

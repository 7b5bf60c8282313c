"""services/common/models/heads.py: each head's log-prob and entropy against torch.distributions on known
numbers, masking, and the Gaussian's log-std travelling with the weights."""

from __future__ import annotations

import numpy as np
import torch
from torch.distributions import Categorical, Independent, Normal

from services.common.envs import EnvSpec
from services.common.models.heads import MASKED_LOGIT, Head
from services.algorithms.ppo.networks import ActorCritic
from services.common.protocol.spaces import Box, Discrete, MultiDiscrete

LOGITS = torch.tensor([[0.5, -1.0, 2.0, 0.0, 1.0, -0.5, 0.25]])


def test_discrete_matches_categorical():
    dist = Head(Discrete(7))(LOGITS)
    ref = Categorical(logits=LOGITS)
    a = torch.tensor([2])
    assert torch.allclose(dist.log_prob(a), ref.log_prob(a)) and torch.allclose(dist.entropy(), ref.entropy())
    assert dist.mode().item() == 2


def test_multidiscrete_is_a_product_of_categoricals():
    dist = Head(MultiDiscrete((4, 3)))(LOGITS)
    a, b = Categorical(logits=LOGITS[:, :4]), Categorical(logits=LOGITS[:, 4:])
    act = torch.tensor([[1, 2]])
    assert torch.allclose(dist.log_prob(act), a.log_prob(act[:, 0]) + b.log_prob(act[:, 1]))
    assert torch.allclose(dist.entropy(), a.entropy() + b.entropy())
    assert dist.sample().shape == (1, 2) and dist.mode().tolist() == [[2, 0]]


def test_gaussian_matches_independent_normal():
    head = Head(Box.of((2,), -2.0, 2.0))
    with torch.no_grad():
        head.log_std.copy_(torch.tensor([0.3, -0.7]))
    mean = torch.tensor([[0.1, -0.4], [1.0, 2.0]])
    dist = head(mean)
    ref = Independent(Normal(mean, torch.tensor([0.3, -0.7]).exp()), 1)
    act = torch.tensor([[3.0, -1.0], [0.5, 0.5]])  # outside the bounds: log-probs of unclipped samples
    assert torch.allclose(dist.log_prob(act), ref.log_prob(act)) and torch.allclose(dist.entropy(), ref.entropy())
    assert dist.sample().shape == (2, 2) and torch.equal(dist.mode(), mean)


def test_masked_actions_are_never_sampled_and_the_rest_renormalised():
    torch.manual_seed(0)
    mask = torch.tensor([[True, False, False, True, False, True, True]])
    dist = Head(MultiDiscrete((4, 3)))(LOGITS.expand(5000, -1), mask.expand(5000, -1))
    samples = dist.sample()
    assert set(samples[:, 0].tolist()) == {0, 3} and set(samples[:, 1].tolist()) == {1, 2}
    allowed = Categorical(logits=LOGITS[:, [0, 3]])
    assert torch.allclose(dist.parts[0].log_prob(torch.tensor([3])), allowed.log_prob(torch.tensor([1])), atol=1e-6)
    only = Head(Discrete(3))(torch.zeros(1, 3), torch.tensor([[False, True, False]]))
    assert only.entropy().item() < 1e-6 and only.probs[0, 0].item() == 0.0
    assert MASKED_LOGIT < -1e6


def test_box_log_std_is_a_weight_and_discrete_keys_are_unchanged():
    box = ActorCritic(EnvSpec((3,), np.dtype(np.float32), Box.of((1,), -2.0, 2.0)), (8,))
    assert "head.log_std" in box.state_dict()
    discrete = ActorCritic(EnvSpec((3,), np.dtype(np.float32), Discrete(2)), (8,))
    assert not any(k.startswith("head.") for k in discrete.state_dict())

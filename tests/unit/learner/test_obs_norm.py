"""Observation normalisation (ppo.normalize_observations): running statistics that agree with numpy
over everything seen, merge across a learner group, and reach actors with the weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.actor.policy import Policy
from services.algorithms.ppo.learner import PPO
from services.config import config_from_dict
from services.algorithms.ppo.networks import ActorCritic
from services.common.models.nets import EnvSpec, ObsNormalizer, to_numpy
from services.common.protocol.spaces import Box, Discrete
from services.common.stats import Metrics
from services.common.protocol.weights import WeightsAssembler, encode_weights
from tests.unit.fragment_factory import make_fragment

SPEC = EnvSpec((3,), np.dtype(np.float32), Discrete(2))


def test_running_statistics_equal_numpy_over_every_batch_seen():
    rng = np.random.default_rng(0)
    batches = [rng.normal(loc=[5.0, -3.0, 100.0], scale=[1.0, 0.1, 20.0], size=(n, 3)) for n in (1, 7, 64, 300)]
    norm = ObsNormalizer(3)
    for b in batches:
        norm.update(torch.tensor(b, dtype=torch.float32))
    seen = np.concatenate(batches).astype(np.float32).astype(np.float64)
    assert norm.count.item() == len(seen)
    np.testing.assert_allclose(norm.mean.numpy(), seen.mean(0), rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(norm.var.numpy(), seen.var(0), rtol=1e-6)
    x = torch.tensor(seen[:5], dtype=torch.float32)
    want = (seen[:5] - seen.mean(0)) / np.sqrt(seen.var(0) + 1e-8)
    np.testing.assert_allclose(norm(x).numpy(), want, rtol=1e-4, atol=1e-5)


def test_summed_moments_of_two_batches_merge_as_one_batch():
    rng = np.random.default_rng(1)
    a, b = (torch.tensor(rng.normal(size=(n, 3))) for n in (10, 30))
    together, summed = ObsNormalizer(3), ObsNormalizer(3)
    together.update(torch.cat([a, b]))
    summed.merge(ObsNormalizer.moments(a) + ObsNormalizer.moments(b))  # what a group of two does
    for name in ("mean", "var", "count"):
        torch.testing.assert_close(getattr(summed, name), getattr(together, name))
    summed.merge(torch.zeros(7, dtype=torch.float64))  # an empty batch changes nothing
    torch.testing.assert_close(summed.count, together.count)


def test_normalised_values_are_clipped():
    norm = ObsNormalizer(1, clip=2.0)
    norm.update(torch.tensor([[-1.0], [1.0]]))
    assert norm(torch.tensor([[100.0], [-100.0], [0.5]])).flatten().tolist() == pytest.approx([2.0, -2.0, 0.5], abs=1e-6)


def test_images_are_not_normalised():
    frames = EnvSpec((4, 84, 84), np.dtype(np.uint8), Discrete(6))
    with pytest.raises(ValueError, match="ppo.normalize_observations"):
        ActorCritic(frames, (64,), normalize_obs=True)


class _GroupOfTwo:
    """A learner group whose other member trained on the very same batch."""

    def sum(self, t):
        return t * 2

    def average_gradients(self, params, weight):
        return 2 * weight


def test_the_learner_updates_the_statistics_and_actors_normalise_alike():
    cfg = config_from_dict({"ppo": {"normalize_observations": True, "hidden_sizes": [8], "batch_steps": 8,
                                    "num_minibatches": 2}})
    learner = PPO(cfg.section("ppo"), SPEC)
    frag = make_fragment(T=4, N=2)
    learner.update([frag])
    seen = frag.obs[:-1].reshape(-1, 3).astype(np.float64)
    assert learner.net.obs_norm.count.item() == len(seen)  # each step's observation once
    np.testing.assert_allclose(learner.net.obs_norm.mean.numpy(), seen.mean(0))
    # The statistics travel with the weights, through the wire codec, into the actor's network.
    chunks = encode_weights(7, to_numpy(learner.policy))
    assembler = WeightsAssembler()
    version, arrays = [r for r in map(assembler.add, chunks) if r is not None][0]
    policy = Policy(cfg, SPEC, 0, Metrics("actor"))
    policy.offer_weights(version, arrays)
    policy.swap()
    obs = torch.tensor(np.random.default_rng(2).normal(scale=50, size=(5, 3)), dtype=torch.float32)
    with torch.no_grad():
        for name in ("mean", "var", "count"):
            torch.testing.assert_close(getattr(policy.net.obs_norm, name), getattr(learner.net.obs_norm, name))
        torch.testing.assert_close(policy.net.value(obs), learner.net.value(obs))
        torch.testing.assert_close(policy.net.dist(obs).logits, learner.net.dist(obs).logits)


@pytest.mark.parametrize("space", [Discrete(2), Box.of((2,), -1.0, 1.0)], ids=str)
def test_every_head_sees_normalised_observations_and_carries_the_statistics(space):
    net = ActorCritic(EnvSpec((3,), np.dtype(np.float32), space), (8,), normalize_obs=True)
    assert {"obs_norm.mean", "obs_norm.var", "obs_norm.count"} <= set(to_numpy(net))
    net.obs_norm.update(torch.tensor([[0.0, 0.0, 0.0], [1000.0, 1000.0, 1000.0]]))
    with torch.no_grad():  # a shift of the raw input by the mean is seen as no shift at all
        features = net._features(torch.tensor([[500.0, 500.0, 500.0]]))
    assert features.abs().max().item() < 1e-6


def test_a_group_merges_every_members_batch():
    cfg = config_from_dict({"ppo": {"normalize_observations": True, "hidden_sizes": [8], "batch_steps": 8,
                                    "num_minibatches": 2}})
    learner = PPO(cfg.section("ppo"), SPEC, sync=_GroupOfTwo())
    frag = make_fragment(T=4, N=2)
    learner.update([frag])
    assert learner.net.obs_norm.count.item() == 2 * 4 * 2
    learner.empty_update()  # a member with no data adds nothing, but takes part
    assert learner.net.obs_norm.count.item() == 16

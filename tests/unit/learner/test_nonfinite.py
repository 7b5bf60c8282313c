"""Non-finite data never reaches the weights: a batch holding NaN or infinity is skipped whole, a step
whose loss or (group-averaged) gradient is not finite is not taken, and weights holding NaN or infinity
are never published or checkpointed (services/algorithms/checks.py, services/learner/distributed.py,
services/learner/trainer.py). The resume side is in test_checkpoint.py."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from kuberl.v1 import common_pb2 as pb
from services.config import config_from_dict
from services.common.protocol.fragments import build_fragment
from services.common.stats import Metrics
from services.common.protocol.tensors import encode
from services.learner.loops import publish
from services.learner.publish import WeightsHub
from services.learner.trainer import Trainer
from tests.unit.fragment_factory import PPO, fragment_arrays
from tests.unit.learner.test_group_steps import FakeGroup

CONFIGS = {
    "ppo": {"algorithm": "ppo", "env": {"num_envs": 2},
            "ppo": {"rollout_steps": 4, "batch_steps": 8, "num_epochs": 1, "num_minibatches": 2, "hidden_sizes": [8]}},
    "dqn": {"algorithm": "dqn", "env": {"num_envs": 2},
            "dqn": {"batch_size": 4, "learning_starts": 4, "buffer_size": 64, "hidden_sizes": [8]}},
    "sac": {"algorithm": "sac", "env": {"id": "Pendulum-v1", "num_envs": 2},
            "sac": {"batch_size": 4, "learning_starts": 4, "buffer_size": 64, "hidden_sizes": [8]}},
}


def trainer_of(name: str, directory, sync=None) -> Trainer:
    return Trainer(config_from_dict(CONFIGS[name]), Metrics("learner"), directory, sync)


def batch(name: str, field: str | None = None, value: float = np.nan) -> pb.TrainingBatch:
    """A good batch for algorithm `name` (CartPole for PPO and DQN, Pendulum for SAC), with `value`
    written into one element of `field` if given."""
    if name == "ppo":
        arrays = fragment_arrays(4, 2, (4,), terminated=[(1, 0)], truncated=[(3, 1)])
        arrays = {k: (v / 100 if k in ("obs", "final_obs") else v) for k, v in arrays.items()}
        if field is not None:
            (arrays["extras"] if field in arrays["extras"] else arrays)[field].reshape(-1)[1] = value
        msg = build_fragment(actor_id="a", seq=0, policy_version=0, algorithm=PPO, env_ids=range(2), **arrays)
        return pb.TrainingBatch(batch_id=7, rollouts=pb.RolloutBatch(fragments=[msg]))
    rng = np.random.default_rng(0)
    B, obs = 6, (4 if name == "dqn" else 3)
    arrays = {"obs": rng.standard_normal((B, obs)).astype(np.float32),
              "actions": (rng.integers(0, 2, B) if name == "dqn" else rng.uniform(-2, 2, (B, 1)).astype(np.float32)),
              "rewards": rng.standard_normal(B).astype(np.float32),
              "next_obs": rng.standard_normal((B, obs)).astype(np.float32),
              "terminated": rng.random(B) < 0.5, "policy_version": np.zeros(B, np.int64)}
    if field is not None:
        arrays[field].reshape(-1)[1] = value
    return pb.TrainingBatch(batch_id=7, transitions=pb.TransitionBatch(**{k: encode(v) for k, v in arrays.items()}))


def state(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.algo.policy.state_dict().items()}


def counter(trainer: Trainer, name: str) -> float:
    return trainer.metrics.counters[f"learner/{name}_total"]


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("name, field, logged", [
    # (decoding a fragment refuses these already: a buffer would have refused the push)
    ("ppo", "obs", "obs: 1 of its 40 values"), ("ppo", "final_obs", "final_obs: 1 of its 8 values"),
    ("ppo", "rewards", "rewards: holds NaN or infinity"),
    ("ppo", "behaviour_logprob", "extras.behaviour_logprob: 1 of its 8 values"),
    ("dqn", "obs", "transitions.obs: 1 of its 24 values"), ("dqn", "next_obs", "transitions.next_obs: 1 of its 24"),
    ("dqn", "rewards", "transitions.rewards: 1 of its 6 values"),
    ("sac", "obs", "transitions.obs: 1 of its 18 values"), ("sac", "actions", "actions: holds NaN or infinity"),
    ("sac", "rewards", "transitions.rewards: 1 of its 6 values"),
])
def test_a_batch_holding_nan_or_infinity_is_skipped_counted_and_the_weights_stay(tmp_path, caplog, name, field,
                                                                                 logged, value):
    trainer = trainer_of(name, tmp_path)
    before = state(trainer)
    with caplog.at_level(logging.ERROR, logger="services.learner.trainer"):
        trainer.train(batch(name, field, value))
    assert trainer.version == 0 and counter(trainer, "batches_nonfinite") == 1
    assert counter(trainer, "batches_invalid") == 0 and counter(trainer, "batches_consumed") == 1
    assert all(torch.equal(before[k], v) for k, v in state(trainer).items())
    assert f"skipping non-finite batch 7: {logged}" in caplog.text
    trainer.train(batch(name))  # the same batch without the bad value trains
    assert trainer.version == 1 and counter(trainer, "batches_nonfinite") == 1
    assert all(torch.isfinite(v).all() for v in state(trainer).values())


def overflowing(trainer: Trainer) -> None:
    """Every parameter at 3e38: finite, but every forward pass overflows to infinity (or NaN)."""
    with torch.no_grad():
        for p in trainer.algo.policy.parameters():
            p.fill_(3e38)
        for module in ("q", "critic"):
            for p in getattr(trainer.algo, module).parameters() if hasattr(trainer.algo, module) else ():
                p.fill_(3e38)


@pytest.mark.parametrize("name, steps", [("ppo", 2), ("dqn", 1), ("sac", 1)])
def test_a_step_whose_loss_or_gradient_is_not_finite_is_not_taken(tmp_path, caplog, name, steps):
    """Finite inputs, finite weights, and yet the loss overflows: no optimiser step, no new version."""
    trainer = trainer_of(name, tmp_path)
    overflowing(trainer)
    before = state(trainer)
    with caplog.at_level(logging.WARNING, logger="services.algorithms.checks"):
        trainer.train(batch(name))
    assert trainer.version == 0 and counter(trainer, "gradient_steps_skipped_nonfinite") == steps
    assert counter(trainer, "batches_nonfinite") == 0
    assert all(torch.equal(before[k], v) for k, v in state(trainer).items())
    assert "its loss or gradient is not finite" in caplog.text
    assert trainer.weights() is not None  # 3e38 is finite: still publishable


def test_a_peers_nonfinite_gradient_makes_this_learner_skip_the_same_step(tmp_path):
    """The group decides on the averaged gradient, the same on every member: a NaN anywhere is skipped
    everywhere, so members never diverge."""
    cfg = config_from_dict(CONFIGS["dqn"])
    group = FakeGroup(peer_weight=4, peer_grad=float("nan"))
    group.state = Trainer(cfg, Metrics("learner"), tmp_path / "rank0").algo.state_dict()
    trainer = Trainer(cfg, Metrics("learner"), tmp_path / "rank1", sync=group)
    before = state(trainer)
    trainer.train(batch("dqn"))
    assert group.calls == [6.0] and trainer.version == 0
    assert counter(trainer, "gradient_steps_skipped_nonfinite") == 1
    assert all(torch.equal(before[k], v) for k, v in state(trainer).items())
    group.peer_grad = 1.0
    trainer.train(batch("dqn"))
    assert trainer.version == 1


def test_a_nonfinite_loss_here_reaches_the_peers_as_a_nan_gradient(tmp_path):
    """DQN's Huber loss has clipped, finite gradients even where the loss is infinite: the gradient this
    learner contributes is made NaN, so the peers skip the step as it does."""
    handed: list[bool] = []

    class Records(FakeGroup):
        def average_gradients(self, params, weight):
            handed.append(all(torch.isfinite(p.grad).all() for p in params if p.grad is not None))
            return super().average_gradients(params, weight)

    cfg = config_from_dict(CONFIGS["dqn"])
    group = Records(peer_weight=4)
    group.state = Trainer(cfg, Metrics("learner"), tmp_path / "rank0").algo.state_dict()
    trainer = Trainer(cfg, Metrics("learner"), tmp_path / "rank1", sync=group)
    trainer.train(batch("dqn"))
    assert handed == [True] and trainer.version == 1
    overflowing(trainer)
    trainer.train(batch("dqn"))
    assert handed == [True, False] and trainer.version == 1
    assert counter(trainer, "gradient_steps_skipped_nonfinite") == 1


def test_a_batch_holding_nan_in_a_group_joins_the_step_with_nothing(tmp_path):
    cfg = config_from_dict(CONFIGS["dqn"])
    group = FakeGroup(peer_weight=4)
    group.state = Trainer(cfg, Metrics("learner"), tmp_path / "rank0").algo.state_dict()
    trainer = Trainer(cfg, Metrics("learner"), tmp_path / "rank1", sync=group)
    trainer.train(batch("dqn", "rewards", np.inf))
    assert group.calls == [0.0] and counter(trainer, "batches_nonfinite") == 1
    assert trainer.version == 1, "the peer's step is this learner's step too"


async def test_nonfinite_weights_are_never_published_or_checkpointed(tmp_path, caplog):
    trainer = trainer_of("ppo", tmp_path)
    assert trainer.checkpoint() is not None
    hub = WeightsHub()
    await publish(hub, trainer)
    assert hub.version == 0
    with torch.no_grad():
        next(trainer.algo.net.parameters()).view(-1)[0] = float("nan")
    trainer.algo.version = 5
    with caplog.at_level(logging.ERROR, logger="services.learner.trainer"):
        assert trainer.weights() is None
        await publish(hub, trainer)
        assert trainer.checkpoint() is None
    assert hub.version == 0, "the last good version stands"
    assert counter(trainer, "weights_refused_nonfinite") == 2 and counter(trainer, "checkpoints_refused_nonfinite") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt-000000000000.pt"]
    assert "not publishing version 5" in caplog.text and "not checkpointing version 5: algo.net." in caplog.text
    hub.close()
